//! Law 8, the laws of the weighted-fair queue (fair shares by weight, bounded lag, no
//! starvation, no idle credit, work conservation, bounded memory), checked through its
//! public API. Law numbers are those of `crates/tower-limits/docs/laws.md`.
//!
//! Every trace comes from a seeded splitmix64 (and proptest with a fixed seed), so the
//! same seed replays the same trace. Exact laws are checked in integers: costs per
//! weight are scaled by `L = 2520`, the least common multiple of the weights 1 to 10.
//! Run with `--nocapture` to see the measured figures.

use std::cell::RefCell;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestRunner};
use tower_limits_core::fair_queue::{FairQueue, FairQueueConfig, QueueKind, Ticket};

/// Every weight used divides it, so `cost * L / weight` is a whole number.
const L: u64 = 2520;

/// A tiny deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform enough in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// In `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// True `percent` times in a hundred.
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

fn queue<T>(tenant: usize, global: usize) -> FairQueue<u32, T> {
    FairQueue::new(FairQueueConfig::new().tenant_queue_limit(tenant).global_queue_limit(global)).unwrap()
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        rng_seed: RngSeed::Fixed(0x00fa_14e0),
        failure_persistence: None,
        ..Config::default()
    })
}

/// Tenants: a weight (1 to 10) and a largest cost (1 to `max_cost`) each, and a seed.
fn tenants(count: std::ops::RangeInclusive<usize>, max_cost: u64) -> impl Strategy<Value = (Vec<u32>, Vec<u64>, u64)> {
    count.prop_flat_map(move |n| {
        (prop::collection::vec(1u32..=10, n), prop::collection::vec(1u64..=max_cost, n), any::<u64>())
    })
}

// ---------------------------------------------------------------------------------------
// Proportional share
// ---------------------------------------------------------------------------------------

/// Worst figures over the prefixes in a bucket.
#[derive(Debug, Clone, Copy)]
struct Worst {
    error: f64,
    jain: f64,
    prefixes: u64,
}

impl Default for Worst {
    fn default() -> Self {
        Worst { error: 0.0, jain: 1.0, prefixes: 0 }
    }
}

impl Worst {
    fn add(&mut self, error: f64, jain: f64) {
        self.error = self.error.max(error);
        self.jain = self.jain.min(jain);
        self.prefixes += 1;
    }

    fn merge(&mut self, other: Worst) {
        self.error = self.error.max(other.error);
        self.jain = self.jain.min(other.jain);
        self.prefixes += other.prefixes;
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct ShareOutcome {
    /// Prefixes of at least 100,000 cost units.
    from_100k: Worst,
    /// Prefixes of at least 1,000,000.
    from_1m: Worst,
    /// Prefixes long enough for the bounds to guarantee 0.002 and 0.999.
    guaranteed: Worst,
    /// The longest such threshold.
    guaranteed_from: u64,
    /// The largest error divided by its proven bound.
    bound_ratio: f64,
    dispatches: u64,
}

impl ShareOutcome {
    fn merge(&mut self, other: &ShareOutcome) {
        self.from_100k.merge(other.from_100k);
        self.from_1m.merge(other.from_1m);
        self.guaranteed.merge(other.guaranteed);
        self.guaranteed_from = self.guaranteed_from.max(other.guaranteed_from);
        self.bound_ratio = self.bound_ratio.max(other.bound_ratio);
        self.dispatches += other.dispatches;
    }
}

/// Every tenant backlogged from the start and topped up after each dispatch; request
/// costs uniform in `1..=max_costs[i]`.
///
/// Checked on every prefix of `T` units: tenant `i`'s share is within
/// `max(M_i, w_i·ΣM/Σw) / T` of `w_i / Σw` (all tenants start at virtual time 0, and
/// each one's cost per weight stays within one request of virtual time), and on every
/// prefix past the length at which that bound (and the matching one for Jain's index)
/// guarantees it, the share error is below 0.002 and Jain's index at least 0.999.
fn run_share(weights: &[u32], max_costs: &[u64], seed: u64) -> ShareOutcome {
    let n = weights.len();
    let mut rng = Rng(seed);
    let mut q = queue(4, 4 * n);
    for (i, (&w, &m)) in weights.iter().zip(max_costs).enumerate() {
        for _ in 0..3 {
            q.enqueue_weighted(i as u32, w, rng.range(1, m), ()).unwrap();
        }
    }
    let w_sum: f64 = weights.iter().map(|&w| f64::from(w)).sum();
    let m_sum: f64 = max_costs.iter().map(|&m| m as f64).sum();
    // error_i * T is at most this.
    let bound: Vec<f64> = (0..n).map(|i| (max_costs[i] as f64).max(f64::from(weights[i]) * m_sum / w_sum)).collect();
    let b_max = (0..n).map(|i| max_costs[i] as f64 / f64::from(weights[i])).fold(0.0, f64::max);
    // Error below 0.002 once T >= 500 * max bound; Jain at least 0.999 once virtual
    // time is 32 times the largest cost per weight: 1 - J <= (b_max / V)^2.
    let guaranteed = (500.0 * bound.iter().copied().fold(0.0, f64::max)).max(32.0 * w_sum * b_max + m_sum);
    let guaranteed_from = (guaranteed.ceil() as u64).max(100_000);
    let end = 2 * guaranteed_from;

    let mut out = ShareOutcome { guaranteed_from, ..ShareOutcome::default() };
    let mut cost = vec![0u64; n];
    let mut total = 0u64;
    while total < end {
        let d = q.pop_next().expect("work-conserving: every tenant is backlogged");
        let i = d.key as usize;
        cost[i] += d.cost;
        total += d.cost;
        out.dispatches += 1;
        q.enqueue_weighted(d.key, weights[i], rng.range(1, max_costs[i]), ()).unwrap();
        if total < 100_000 {
            continue;
        }
        let t = total as f64;
        let mut error = 0.0f64;
        let (mut sum, mut sum_sq) = (0.0, 0.0);
        for j in 0..n {
            let w = f64::from(weights[j]);
            let e = (cost[j] as f64 / t - w / w_sum).abs();
            let ratio = e * t / bound[j];
            assert!(ratio <= 1.0 + 1e-9, "tenant {j} share error {e} above its bound {} at {total}", bound[j] / t);
            out.bound_ratio = out.bound_ratio.max(ratio);
            error = error.max(e);
            let x = cost[j] as f64 / w;
            sum += x;
            sum_sq += x * x;
        }
        let jain = sum * sum / (n as f64 * sum_sq);
        out.from_100k.add(error, jain);
        if total >= 1_000_000 {
            out.from_1m.add(error, jain);
        }
        if total >= guaranteed_from {
            assert!(error < 0.002, "share error {error} at {total} >= {guaranteed_from}");
            assert!(jain >= 0.999, "Jain index {jain} at {total} >= {guaranteed_from}");
            out.guaranteed.add(error, jain);
        }
    }
    out
}

fn report_share(title: &str, o: &ShareOutcome) {
    eprintln!(
        "{title}: {} dispatches; prefixes >= 100k units: worst share error {:.5}, min Jain {:.5}; \
         >= 1M: {:.5}, {:.6}; past the guaranteed length (at most {} units): {:.6}, {:.6}; \
         worst error / proven bound {:.3}",
        o.dispatches,
        o.from_100k.error,
        o.from_100k.jain,
        o.from_1m.error,
        o.from_1m.jain,
        o.guaranteed_from,
        o.guaranteed.error,
        o.guaranteed.jain,
        o.bound_ratio,
    );
}

#[test]
fn proportional_share_with_costs_up_to_1000() {
    let mut total = ShareOutcome::default();
    // The extremes first: 50 tenants all up to 1000; two tenants of weights 1 and 10.
    let fifty: Vec<u32> = (0..50).map(|i| i % 10 + 1).collect();
    total.merge(&run_share(&fifty, &[1000; 50], 1));
    total.merge(&run_share(&[1, 10], &[1000, 1000], 2));
    total.merge(&run_share(&[10, 1], &[1, 1000], 3));
    let cases = if cfg!(debug_assertions) { 12 } else { 64 };
    let outcome = RefCell::new(ShareOutcome::default());
    runner(cases)
        .run(&tenants(2..=50, 1000), |(weights, max_costs, seed)| {
            outcome.borrow_mut().merge(&run_share(&weights, &max_costs, seed));
            Ok(())
        })
        .unwrap();
    total.merge(&outcome.into_inner());
    report_share("proportional share, 2-50 tenants, weights 1-10, costs 1-1000", &total);
}

#[test]
fn proportional_share_on_100k_prefixes_with_small_costs() {
    let cases = if cfg!(debug_assertions) { 12 } else { 64 };
    let outcome = RefCell::new(ShareOutcome::default());
    runner(cases)
        .run(&tenants(2..=50, 10), |(weights, max_costs, seed)| {
            let o = run_share(&weights, &max_costs, seed);
            prop_assert_eq!(o.guaranteed_from, 100_000, "small costs are guaranteed from 100k");
            outcome.borrow_mut().merge(&o);
            Ok(())
        })
        .unwrap();
    report_share("proportional share, 2-50 tenants, weights 1-10, costs 1-10", &outcome.into_inner());
}

// ---------------------------------------------------------------------------------------
// Random arrivals: bounded lag, no starvation, work conservation
// ---------------------------------------------------------------------------------------

struct Pending {
    tenant: usize,
    cost: u64,
    /// The tenant's queued cost ahead of this request when it arrived.
    ahead: u64,
    /// Every tenant's dispatched cost when it arrived.
    seen: Vec<u64>,
    ticket: Ticket,
}

#[derive(Debug, Default, Clone, Copy)]
struct ArrivalOutcome {
    dispatches: u64,
    /// The largest lag between two backlogged tenants, divided by its bound.
    lag_ratio: f64,
    /// The largest cost another tenant received while a request waited, divided by
    /// its bound.
    wait_ratio: f64,
    /// Same as `lag_ratio`, for a returning tenant ahead of one that stayed backlogged.
    return_ratio: f64,
    returns: u64,
    longest_idle: u64,
}

impl ArrivalOutcome {
    fn merge(&mut self, o: &ArrivalOutcome) {
        self.dispatches += o.dispatches;
        self.lag_ratio = self.lag_ratio.max(o.lag_ratio);
        self.wait_ratio = self.wait_ratio.max(o.wait_ratio);
        self.return_ratio = self.return_ratio.max(o.return_ratio);
        self.returns += o.returns;
        self.longest_idle = self.longest_idle.max(o.longest_idle);
    }
}

/// A driver that keeps its own account of the queue and checks, at every dispatch:
///
/// - **work conservation**: something is dispatched exactly when something is queued,
///   and it is what `peek_next` showed;
/// - **bounded lag**: for every pair of tenants backlogged since the later of them
///   became backlogged, over every sub-interval,
///   `|cost_i / w_i - cost_j / w_j| <= M_i / w_i + M_j / w_j`;
/// - **no starvation**: while a request of tenant `i` waits, having found `A` of its
///   tenant's cost queued ahead, no other tenant `j` receives more than
///   `w_j * (A + M_i) / w_i + M_j`.
struct Driver {
    q: FairQueue<u32, usize>,
    weights: Vec<u32>,
    max_costs: Vec<u64>,
    queued: Vec<u64>,
    queued_cost: Vec<u64>,
    dispatched: Vec<u64>,
    pending: Vec<Option<Pending>>,
    /// Tickets of queued requests, for cancelling one at random, and their places.
    live: Vec<usize>,
    place: Vec<usize>,
    /// Per pair (i < j): scaled `x_i - x_j` since the pair's joint backlog began, and
    /// its lowest and highest values since.
    diff: Vec<(i64, i64, i64)>,
    out: ArrivalOutcome,
}

impl Driver {
    fn new(weights: &[u32], max_costs: &[u64], tenant_limit: usize, global_limit: usize) -> Self {
        let n = weights.len();
        Driver {
            q: queue(tenant_limit, global_limit),
            weights: weights.to_vec(),
            max_costs: max_costs.to_vec(),
            queued: vec![0; n],
            queued_cost: vec![0; n],
            dispatched: vec![0; n],
            pending: Vec::new(),
            live: Vec::new(),
            place: Vec::new(),
            diff: vec![(0, 0, 0); n * n],
            out: ArrivalOutcome::default(),
        }
    }

    fn n(&self) -> usize {
        self.weights.len()
    }

    fn pair(&mut self, i: usize, j: usize) -> &mut (i64, i64, i64) {
        let n = self.n();
        &mut self.diff[i.min(j) * n + i.max(j)]
    }

    /// The lag bound of a pair, scaled by `L`.
    fn lag_bound(&self, i: usize, j: usize) -> i64 {
        (L * self.max_costs[i] / u64::from(self.weights[i]) + L * self.max_costs[j] / u64::from(self.weights[j])) as i64
    }

    fn enqueue(&mut self, i: usize, cost: u64) -> bool {
        let id = self.pending.len();
        let ticket = match self.q.enqueue_weighted(i as u32, self.weights[i], cost, id) {
            Ok(t) => t,
            Err(e) => {
                match e.kind() {
                    QueueKind::Tenant => assert!(self.queued[i] as usize >= self.q.config().tenant_queue_limit),
                    QueueKind::Global => assert!(self.q.len() >= self.q.config().global_queue_limit),
                }
                assert_eq!(e.into_item(), id);
                return false;
            }
        };
        if self.queued[i] == 0 {
            for j in 0..self.n() {
                if j != i {
                    *self.pair(i, j) = (0, 0, 0);
                }
            }
        }
        self.pending.push(Some(Pending {
            tenant: i,
            cost,
            ahead: self.queued_cost[i],
            seen: self.dispatched.clone(),
            ticket,
        }));
        self.place.push(self.live.len());
        self.live.push(id);
        self.queued[i] += 1;
        self.queued_cost[i] += cost;
        true
    }

    fn forget(&mut self, id: usize) -> Pending {
        let p = self.pending[id].take().expect("a request leaves once");
        let at = self.place[id];
        self.live.swap_remove(at);
        if let Some(&moved) = self.live.get(at) {
            self.place[moved] = at;
        }
        self.queued[p.tenant] -= 1;
        self.queued_cost[p.tenant] -= p.cost;
        p
    }

    fn cancel_random(&mut self, rng: &mut Rng) {
        if self.live.is_empty() {
            return;
        }
        let id = self.live[rng.below(self.live.len() as u64) as usize];
        let ticket = self.pending[id].as_ref().unwrap().ticket;
        assert_eq!(self.q.cancel(ticket), Some(id));
        self.forget(id);
    }

    /// Dispatches one request, checking the laws; returns its tenant.
    fn pop(&mut self) -> Option<usize> {
        let peeked = self.q.peek_next().map(|n| (*n.key, n.ticket, n.cost));
        let Some(d) = self.q.pop_next() else {
            assert!(self.live.is_empty() && peeked.is_none(), "work-conserving");
            return None;
        };
        assert_eq!(peeked, Some((d.key, d.ticket, d.cost)));
        let p = self.forget(d.item);
        let i = p.tenant;
        assert_eq!((d.key as usize, d.cost, d.ticket), (i, p.cost, p.ticket));
        self.out.dispatches += 1;

        let (w_i, m_i) = (u64::from(self.weights[i]), self.max_costs[i]);
        for j in (0..self.n()).filter(|&j| j != i) {
            // No starvation.
            let got = self.dispatched[j] - p.seen[j];
            let (w_j, m_j) = (u64::from(self.weights[j]), self.max_costs[j]);
            let allowed = w_j * (p.ahead + m_i) + m_j * w_i;
            assert!(got * w_i <= allowed, "tenant {j} got {got} while a request of {i} waited");
            self.out.wait_ratio = self.out.wait_ratio.max((got * w_i) as f64 / allowed as f64);
            // Bounded lag (i was backlogged until this dispatch).
            if self.queued[j] > 0 {
                let step = (p.cost * L / w_i) as i64;
                let sign = if i < j { 1 } else { -1 };
                let bound = self.lag_bound(i, j);
                let (d, lo, hi) = self.pair(i, j);
                *d += sign * step;
                let lag = (*d - *lo).max(*hi - *d);
                *lo = (*lo).min(*d);
                *hi = (*hi).max(*d);
                assert!(lag <= bound, "tenants {i} and {j}: lag {lag} above {bound} (scaled by {L})");
                self.out.lag_ratio = self.out.lag_ratio.max(lag as f64 / bound as f64);
            }
        }
        self.dispatched[i] += p.cost;
        Some(i)
    }
}

/// Tenants switch on and off; on ones send requests at random; some requests are
/// cancelled. Queues fill and drain, so pairs become backlogged together and apart.
fn run_arrivals(weights: &[u32], max_costs: &[u64], seed: u64, steps: usize) -> ArrivalOutcome {
    let n = weights.len();
    let mut rng = Rng(seed);
    let mut d = Driver::new(weights, max_costs, 24, 12 * n);
    let mut on: Vec<bool> = (0..n).map(|_| rng.chance(50)).collect();
    let arrive = rng.range(40, 60);
    for _ in 0..steps {
        if rng.chance(2) {
            let i = rng.below(n as u64) as usize;
            on[i] = !on[i];
        }
        let r = rng.below(100);
        if r < arrive {
            let i = rng.below(n as u64) as usize;
            if on[i] {
                d.enqueue(i, rng.range(1, max_costs[i]));
            }
        } else if r < 95 {
            d.pop();
        } else {
            d.cancel_random(&mut rng);
        }
    }
    while d.pop().is_some() {}
    assert_eq!(d.q.stats().tracked_tenants, 0);
    d.out
}

#[test]
fn lag_and_waiting_are_bounded_under_random_arrivals() {
    let steps = if cfg!(debug_assertions) { 20_000 } else { 100_000 };
    let cases = if cfg!(debug_assertions) { 16 } else { 64 };
    let outcome = RefCell::new(ArrivalOutcome::default());
    runner(cases)
        .run(&tenants(2..=10, 1000), |(weights, max_costs, seed)| {
            outcome.borrow_mut().merge(&run_arrivals(&weights, &max_costs, seed, steps));
            Ok(())
        })
        .unwrap();
    let o = outcome.into_inner();
    eprintln!(
        "random arrivals, 2-10 tenants, weights 1-10, costs 1-1000: {} dispatches; \
         worst pairwise lag / (M_i/w_i + M_j/w_j) {:.3}; worst cost received by another tenant \
         while a request waited / (w_j(A + M_i)/w_i + M_j) {:.3}",
        o.dispatches, o.lag_ratio, o.wait_ratio
    );
    assert!(o.lag_ratio > 0.5 && o.wait_ratio > 0.3, "the workload exercises the bounds");
}

// ---------------------------------------------------------------------------------------
// No idle credit
// ---------------------------------------------------------------------------------------

/// Tenant 0 stays backlogged; tenant 1 works in bursts separated by idle periods of up
/// to 20,000 dispatches; others come and go. From each return, over the returning
/// tenant's backlog, `cost_1/w_1 - cost_0/w_0 <= M_1/w_1 + M_0/w_0`, however long the
/// idle period was: nothing is banked while idle.
fn run_returns(weights: &[u32], max_costs: &[u64], seed: u64, returns: u64) -> ArrivalOutcome {
    let n = weights.len();
    let mut rng = Rng(seed);
    let mut d = Driver::new(weights, max_costs, 16, 16 * n);
    let bound = d.lag_bound(0, 1);
    for _ in 0..4 {
        d.enqueue(0, rng.range(1, max_costs[0]));
    }
    while d.out.returns < returns {
        // Idle: others are served.
        let idle = if rng.chance(30) { rng.range(1_000, 20_000) } else { rng.range(0, 300) };
        for _ in 0..idle {
            for (i, &m) in max_costs.iter().enumerate().skip(2) {
                if d.queued[i] < 2 && rng.chance(30) {
                    d.enqueue(i, rng.range(1, m));
                }
            }
            let i = d.pop().unwrap();
            if i == 0 {
                d.enqueue(0, rng.range(1, max_costs[0]));
            }
        }
        // Back: a burst, with arrivals while it is served.
        d.out.returns += 1;
        d.out.longest_idle = d.out.longest_idle.max(idle);
        let (w0, w1) = (u64::from(weights[0]), u64::from(weights[1]));
        let start = (d.dispatched[0], d.dispatched[1]);
        let mut burst = rng.range(1, 40);
        d.enqueue(1, rng.range(1, max_costs[1]));
        burst -= 1;
        while d.queued[1] > 0 {
            if burst > 0 && d.queued[1] < 8 && rng.chance(60) {
                d.enqueue(1, rng.range(1, max_costs[1]));
                burst -= 1;
            }
            if rng.chance(3) {
                d.cancel_random(&mut rng);
            }
            if d.queued[0] == 0 {
                d.enqueue(0, rng.range(1, max_costs[0]));
            }
            let i = d.pop().unwrap();
            if i == 0 {
                d.enqueue(0, rng.range(1, max_costs[0]));
            }
            let ahead = ((d.dispatched[1] - start.1) * L / w1) as i64 - ((d.dispatched[0] - start.0) * L / w0) as i64;
            assert!(ahead <= bound, "a returning tenant got {ahead} ahead, above {bound} (scaled by {L})");
            d.out.return_ratio = d.out.return_ratio.max(ahead as f64 / bound as f64);
        }
    }
    d.out
}

#[test]
fn no_idle_credit() {
    let returns = if cfg!(debug_assertions) { 30 } else { 200 };
    let cases = if cfg!(debug_assertions) { 8 } else { 32 };
    let outcome = RefCell::new(ArrivalOutcome::default());
    runner(cases)
        .run(&tenants(2..=6, 1000), |(weights, max_costs, seed)| {
            outcome.borrow_mut().merge(&run_returns(&weights, &max_costs, seed, returns));
            Ok(())
        })
        .unwrap();
    let o = outcome.into_inner();
    eprintln!(
        "no idle credit: {} returns after idle periods of up to {} dispatches; worst lead of a \
         returning tenant over one that stayed backlogged / (M_r/w_r + M_b/w_b) {:.3}; worst \
         pairwise lag ratio {:.3}",
        o.returns, o.longest_idle, o.return_ratio, o.lag_ratio
    );
}

// ---------------------------------------------------------------------------------------
// Bounded memory
// ---------------------------------------------------------------------------------------

#[test]
fn memory_stays_bounded() {
    const TENANTS: u64 = 500;
    const TENANT_LIMIT: usize = 3;
    const GLOBAL_LIMIT: usize = 40;
    let mut rng = Rng(7);
    let mut q = queue::<()>(TENANT_LIMIT, GLOBAL_LIMIT);
    let mut queued = vec![0usize; TENANTS as usize];
    let steps = if cfg!(debug_assertions) { 100_000 } else { 500_000 };
    let mut tickets = Vec::new();
    for _ in 0..steps {
        if rng.chance(55) {
            let key = rng.below(TENANTS) as u32;
            let weight = rng.range(1, 10) as u32;
            match q.enqueue_weighted(key, weight, rng.range(1, 1000), ()) {
                Ok(t) => {
                    queued[key as usize] += 1;
                    tickets.push((t, key));
                }
                Err(e) if e.is_tenant() => assert_eq!(queued[key as usize], TENANT_LIMIT),
                Err(_) => assert_eq!(q.len(), GLOBAL_LIMIT),
            }
        } else if rng.chance(90) {
            if let Some(d) = q.pop_next() {
                queued[d.key as usize] -= 1;
            }
        } else if !tickets.is_empty() {
            let (t, key) = tickets.swap_remove(rng.below(tickets.len() as u64) as usize);
            if q.cancel(t).is_some() {
                queued[key as usize] -= 1;
            }
        }
        let stats = q.stats();
        assert!(stats.queued <= GLOBAL_LIMIT);
        assert!(stats.backlogged_tenants <= stats.queued);
        assert!(stats.tracked_tenants <= stats.backlogged_tenants + GLOBAL_LIMIT);
        if stats.queued == 0 {
            assert_eq!(stats.tracked_tenants, 0, "an empty queue keeps no record");
        }
        assert!(queued.iter().all(|&n| n <= TENANT_LIMIT));
        if tickets.len() > 10_000 {
            tickets.drain(..5_000);
        }
    }
    for key in 0..TENANTS as u32 {
        let held = q.tenant_stats(&key).map_or(0, |s| s.queued);
        assert_eq!(held, queued[key as usize]);
    }
    let stats = q.stats();
    assert!(stats.refused_tenant_full > 0 && stats.refused_global_full > 0 && stats.evicted_idle > 0);
    while q.pop_next().is_some() {}
    assert_eq!(q.stats().tracked_tenants, 0);
    eprintln!("bounded memory: {stats:?}");
}

/// One-shot tenants' records go once virtual time passes their finish tags: after the
/// backlogged tenant `b` has received `w_b * max(c_k / w_k) + M_b` more cost.
#[test]
fn idle_records_are_dropped_once_their_finish_tag_is_reached() {
    let mut rng = Rng(11);
    for _ in 0..50 {
        let mut q = queue::<()>(64, 256);
        let (w_b, m_b) = (rng.range(1, 10), rng.range(1, 1000));
        for _ in 0..8 {
            q.enqueue_weighted(0, w_b as u32, rng.range(1, m_b), ()).unwrap();
        }
        let mut one_shot = 0.0f64;
        for key in 1..=30 {
            let (w, c) = (rng.range(1, 10), rng.range(1, 1000));
            one_shot = one_shot.max(c as f64 / w as f64);
            q.enqueue_weighted(key, w as u32, c, ()).unwrap();
        }
        while (1..=30u32).any(|k| q.tenant_stats(&k).is_some_and(|s| s.queued > 0)) {
            if q.pop_next().unwrap().key == 0 {
                q.enqueue_weighted(0, w_b as u32, rng.range(1, m_b), ()).unwrap();
            }
        }
        let mut served = 0;
        while served as f64 <= w_b as f64 * one_shot + m_b as f64 {
            let d = q.pop_next().unwrap();
            assert_eq!(d.key, 0);
            served += d.cost;
            q.enqueue_weighted(0, w_b as u32, rng.range(1, m_b), ()).unwrap();
        }
        assert_eq!(q.stats().tracked_tenants, 1, "only the backlogged tenant is left");
    }
}

// ---------------------------------------------------------------------------------------
// Conservation
// ---------------------------------------------------------------------------------------

/// A million random operations: enqueues (some refused), dispatches, cancels of queued
/// requests, and cancels with tickets already dispatched or cancelled (their slots often
/// reused since). Every item is dispatched, cancelled, refused or still queued, exactly
/// once, and every counter agrees.
#[test]
fn conservation_over_a_million_operations() {
    const TENANTS: u64 = 64;
    const OPS: usize = 1_000_000;
    #[derive(Clone, Copy, PartialEq, Eq, Debug)]
    enum State {
        Queued,
        Dispatched,
        Cancelled,
        Refused,
    }
    struct Item {
        state: State,
        ticket: Option<Ticket>,
        key: u32,
        cost: u64,
        /// Its place in `live` while queued.
        place: usize,
    }
    fn unlive(live: &mut Vec<u32>, items: &mut [Item], id: u32) {
        let at = items[id as usize].place;
        live.swap_remove(at);
        if let Some(&moved) = live.get(at) {
            items[moved as usize].place = at;
        }
    }

    let mut rng = Rng(0xc0ffee);
    let mut q: FairQueue<u32, u32> = queue(16, 256);
    let mut items: Vec<Item> = Vec::with_capacity(OPS / 2);
    let mut live: Vec<u32> = Vec::new();
    let mut dead: Vec<u32> = Vec::new();
    let mut per_tenant = vec![0usize; TENANTS as usize];
    let (mut dispatched, mut cancelled, mut refused, mut cost_out) = (0u64, 0u64, 0u64, 0u64);
    let (mut dead_dispatched, mut dead_cancelled) = (0u64, 0u64);
    let mut last_arrival: Option<u64> = None;

    for _ in 0..OPS {
        match rng.below(100) {
            0..=44 => {
                let id = items.len() as u32;
                let key = rng.below(TENANTS) as u32;
                let cost = rng.range(0, 500);
                let (state, ticket) = match q.enqueue_weighted(key, rng.range(1, 10) as u32, cost, id) {
                    Ok(t) => {
                        // Tickets compare in arrival order.
                        assert!(last_arrival.is_none_or(|a| t.arrival() > a), "arrival numbers grow");
                        last_arrival = Some(t.arrival());
                        per_tenant[key as usize] += 1;
                        live.push(id);
                        (State::Queued, Some(t))
                    }
                    Err(e) => {
                        assert_eq!(e.into_item(), id, "a refused item comes back");
                        refused += 1;
                        (State::Refused, None)
                    }
                };
                items.push(Item { state, ticket, key, cost, place: live.len().wrapping_sub(1) });
            }
            45..=79 => match q.pop_next() {
                Some(d) => {
                    let item = &mut items[d.item as usize];
                    assert_eq!(item.state, State::Queued);
                    assert_eq!((Some(d.ticket), d.key, d.cost), (item.ticket, item.key, item.cost));
                    item.state = State::Dispatched;
                    per_tenant[d.key as usize] -= 1;
                    dispatched += 1;
                    cost_out += d.cost;
                    unlive(&mut live, &mut items, d.item);
                    dead.push(d.item);
                }
                None => assert!(live.is_empty() && q.is_empty(), "work-conserving"),
            },
            80..=89 if !live.is_empty() => {
                let id = live[rng.below(live.len() as u64) as usize];
                let item = &mut items[id as usize];
                assert_eq!(q.cancel(item.ticket.unwrap()), Some(id));
                item.state = State::Cancelled;
                per_tenant[item.key as usize] -= 1;
                cancelled += 1;
                unlive(&mut live, &mut items, id);
                dead.push(id);
            }
            90..=99 if !dead.is_empty() => {
                let item = &items[dead[rng.below(dead.len() as u64) as usize] as usize];
                let t = item.ticket.unwrap();
                let before = q.len();
                assert_eq!(q.cancel(t), None);
                assert_eq!(q.get(t), None);
                assert_eq!(q.len(), before);
                match item.state {
                    State::Dispatched => dead_dispatched += 1,
                    _ => dead_cancelled += 1,
                }
            }
            _ => {}
        }
        assert_eq!(q.len(), live.len());
        assert_eq!(q.is_empty(), live.is_empty());
        if dead.len() > 4096 {
            dead.drain(..3072);
        }
    }

    let stats = q.stats();
    let total = items.len() as u64;
    assert_eq!(stats.enqueued, total - refused);
    assert_eq!((stats.dispatched, stats.cancelled), (dispatched, cancelled));
    assert_eq!(stats.refused_tenant_full + stats.refused_global_full, refused);
    assert_eq!(stats.dispatched_cost, cost_out);
    assert_eq!(stats.queued, live.len());
    for key in 0..TENANTS as u32 {
        assert_eq!(q.tenant_stats(&key).map_or(0, |s| s.queued), per_tenant[key as usize]);
    }
    // The backlog names every tenant with requests queued, with their count and cost.
    let mut backlog: Vec<(u32, u64, u64)> = q.backlog().map(|(k, n, c)| (*k, n, c)).collect();
    backlog.sort_unstable();
    let mut expected: Vec<(u32, u64, u64)> = Vec::new();
    for key in 0..TENANTS as u32 {
        let queued = live.iter().map(|&id| &items[id as usize]).filter(|i| i.key == key);
        let (n, cost) = queued.fold((0, 0), |(n, c), i| (n + 1, c + i.cost));
        if n > 0 {
            expected.push((key, n, cost));
        }
    }
    assert_eq!(backlog, expected);
    assert!(!backlog.is_empty());
    let count = |items: &[Item], s: State| items.iter().filter(|i| i.state == s).count() as u64;
    assert_eq!(count(&items, State::Queued), live.len() as u64);
    assert_eq!(count(&items, State::Dispatched), dispatched);
    assert_eq!(count(&items, State::Cancelled), cancelled);
    assert_eq!(count(&items, State::Refused), refused);
    assert_eq!(dispatched + cancelled + refused + live.len() as u64, total);
    // What is still queued comes out, each item once.
    while let Some(d) = q.pop_next() {
        let item = &mut items[d.item as usize];
        assert_eq!(item.state, State::Queued);
        item.state = State::Dispatched;
    }
    assert_eq!(count(&items, State::Queued), 0);
    assert_eq!(q.stats().tracked_tenants, 0);
    assert!(refused > 0 && dead_dispatched > 0 && dead_cancelled > 0);
    eprintln!(
        "conservation: {OPS} operations, {total} enqueues ({refused} refused), {dispatched} dispatched, \
         {cancelled} cancelled, {} left queued, dead tickets tried: {dead_dispatched} dispatched, \
         {dead_cancelled} cancelled",
        live.len()
    );
}

/// What the queue says about itself: its counters per tenant (dispatched and queued, in
/// requests and cost, and the weight last given), its emptiness, its description, and
/// the weights its configuration gives by name.
#[test]
fn the_queue_reports_what_it_holds() {
    let mut q: FairQueue<u32, &str> = queue(8, 64);
    assert!(q.is_empty());
    assert_eq!(q.tenant_stats(&1), None);
    q.enqueue_weighted(1, 3, 5, "a").unwrap();
    q.enqueue_weighted(1, 2, 7, "b").unwrap();
    q.enqueue_weighted(2, 1, 11, "c").unwrap();
    assert!(!q.is_empty());
    let one = q.tenant_stats(&1).unwrap();
    assert_eq!((one.weight, one.queued, one.queued_cost, one.dispatched, one.dispatched_cost), (2, 2, 12, 0, 0));
    // Tenant 1's head starts first (both start at zero; it arrived first).
    let d = q.pop_next().unwrap();
    assert_eq!((d.key, d.cost, d.item), (1, 5, "a"));
    let one = q.tenant_stats(&1).unwrap();
    assert_eq!((one.queued, one.queued_cost, one.dispatched, one.dispatched_cost), (1, 7, 1, 5));
    let _ = q.pop_next().unwrap();
    let _ = q.pop_next().unwrap();
    assert!(q.is_empty());
    // Records of tenants still due service are kept until their finish tag is reached.
    if let Some(one) = q.tenant_stats(&1) {
        assert_eq!((one.queued, one.dispatched, one.dispatched_cost), (0, 2, 12));
    }
    let shown = format!("{q:?}");
    assert!(shown.starts_with("FairQueue {") && shown.contains("queued: 0"), "{shown}");

    let config = FairQueueConfig::new().default_weight(3).weight("acme", 7);
    assert_eq!((config.weight_for("acme"), config.weight_for("globex")), (7, 3));
    // The largest queue limits are accepted; one more is refused, naming the field.
    let largest = tower_limits_core::fair_queue::MAX_QUEUE_LIMIT;
    assert!(FairQueueConfig::new().tenant_queue_limit(largest).global_queue_limit(largest).validate().is_ok());
    let error = FairQueueConfig::new().global_queue_limit(largest + 1).validate().unwrap_err();
    assert!(error.to_string().contains("global_queue_limit"), "{error}");
}
