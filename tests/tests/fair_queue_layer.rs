//! Law 10: the `FairQueueLayer` through its public API, on paused tokio time: shares by
//! weight with slots and with a rate, work conservation, exact rate instants without a
//! herd of wake-ups, queue limits and their answers, queueing time, cancellation at every
//! await point, and conservation under random operations. Run with `--nocapture` for the
//! measured figures. Law numbers are those of `crates/tower-limits/docs/laws.md`.
//!
//! No test sleeps to pass: time only moves when every task waits (tokio's paused clock)
//! or by an explicit `advance`. A lost wake-up shows as a `timeout` firing, not a hang.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio::time::{Instant as TokioInstant, timeout};
use tower::{BoxError, Service, ServiceBuilder, ServiceExt};
use tower_limits::core::fair_queue::FairQueueConfig;
use tower_limits::extract::{CostFn, FromExtension, KeyFn};
use tower_limits::http::HttpAnswer;
use tower_limits::{
    ErrorKind, FairQueueLayer, Instant, LimitError, LimitPolicy, LimitSet, LimitSetPolicy, Quota, TenantKey, nz,
};
use tower_limits_tests::quota;
use tower_test::mock;

/// A request: its tenant's number and its cost.
type Job = (u32, u64);
type Keys = KeyFn<fn(&Job) -> Option<TenantKey>, Job>;
type Costs = CostFn<fn(&Job) -> u64, Job>;
type Log = Arc<Mutex<Vec<(Job, Duration)>>>;

fn tenant(i: u32) -> TenantKey {
    TenantKey::single(format!("t{i}")).unwrap()
}

fn keys() -> Keys {
    KeyFn::new((|j: &Job| Some(tenant(j.0))) as fn(&Job) -> Option<TenantKey>)
}

fn costs() -> Costs {
    CostFn::new((|j: &Job| j.1) as fn(&Job) -> u64)
}

/// Tenant `t{i}` weighs `weights[i]`.
fn config(weights: &[u32]) -> FairQueueConfig {
    let mut config = FairQueueConfig::new().tenant_queue_limit(64).global_queue_limit(4096);
    for (i, &w) in weights.iter().enumerate() {
        config = config.weight(format!("t{i}"), w);
    }
    config
}

/// One global token bucket counting cost.
fn bucket(quota: Quota) -> LimitSet {
    LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::token_bucket("tokens", quota).counting_cost())).unwrap()
}

fn tokens_left(set: &LimitSet) -> u64 {
    set.peek(&TenantKey::global(), Instant::ZERO)[0].snapshot.remaining
}

fn limit_error(e: &BoxError) -> &LimitError {
    e.downcast_ref::<LimitError>().expect("a LimitError")
}

async fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *f).poll(cx))).await
}

/// Lets every task that is ready run (time does not move).
async fn settle() {
    for _ in 0..8 {
        tokio::task::yield_now().await;
    }
}

/// A tiny deterministic generator (splitmix64), as in the scheduler's laws.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

// ---------------------------------------------------------------------------------------
// Shares by weight
// ---------------------------------------------------------------------------------------

/// The inner service of the share runs: logs each admitted job with the time since
/// `start`, signals `reached` once the logged cost reaches `target`, and answers after
/// `service_time`.
fn recorder(
    log: Log,
    target: u64,
    reached: Arc<Notify>,
    service_time: Duration,
) -> impl Service<Job, Response = (), Error = BoxError, Future: Send> + Clone + Send + 'static {
    let total = Arc::new(AtomicU64::new(0));
    let start = TokioInstant::now();
    tower::service_fn(move |job: Job| {
        log.lock().unwrap().push((job, start.elapsed()));
        if total.fetch_add(job.1, Ordering::SeqCst) + job.1 >= target {
            reached.notify_one();
        }
        async move {
            if !service_time.is_zero() {
                tokio::time::sleep(service_time).await;
            }
            Ok::<_, BoxError>(())
        }
    })
}

/// Keeps `per_tenant` requests of every tenant outstanding (each task sends its next
/// request as soon as the previous one is answered), costs uniform in
/// `1..=max_costs[i]`, until the recorder says `reached`.
async fn keep_backlogged<S>(svc: S, reached: Arc<Notify>, max_costs: &[u64], per_tenant: usize, seed: u64)
where
    S: Service<Job, Response = (), Error = BoxError> + Clone + Send + 'static,
    S::Future: Send,
{
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = JoinSet::new();
    for (i, &max_cost) in max_costs.iter().enumerate() {
        let rng = Arc::new(Mutex::new(Rng(seed ^ (i as u64 * 0x1234_5678))));
        for _ in 0..per_tenant {
            let (mut svc, rng, stop) = (svc.clone(), rng.clone(), stop.clone());
            tasks.spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let cost = rng.lock().unwrap().range(1, max_cost);
                    svc.ready().await.unwrap().call((i as u32, cost)).await.expect("never refused");
                }
            });
        }
    }
    // A lost wake-up would leave every task waiting: the paused clock then runs to this
    // timeout instead of hanging.
    timeout(Duration::from_secs(1_000_000), reached.notified()).await.expect("the run went on to its end");
    stop.store(true, Ordering::SeqCst);
    tasks.abort_all();
}

/// The prefix length from which the scheduler's bounds guarantee a share error below
/// 0.002 and Jain's index at least 0.999 (as in `fair_queue_laws.rs`).
fn guaranteed_from(weights: &[u32], max_costs: &[u64]) -> u64 {
    let w_sum: f64 = weights.iter().map(|&w| f64::from(w)).sum();
    let m_sum: f64 = max_costs.iter().map(|&m| m as f64).sum();
    let bound = (0..weights.len())
        .map(|i| (max_costs[i] as f64).max(f64::from(weights[i]) * m_sum / w_sum))
        .fold(0.0, f64::max);
    let b_max = (0..weights.len()).map(|i| max_costs[i] as f64 / f64::from(weights[i])).fold(0.0, f64::max);
    let guaranteed = (500.0 * bound).max(32.0 * w_sum * b_max + m_sum);
    (guaranteed.ceil() as u64).max(100_000)
}

#[derive(Default)]
struct Shares {
    admissions: usize,
    total: u64,
    worst_error: f64,
    min_jain: f64,
    guaranteed_from: u64,
    bound_ratio: f64,
}

impl std::fmt::Display for Shares {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} admissions, {} cost units; prefixes >= 100k units: worst share error {:.5}, min Jain {:.6}; \
             bounds guarantee 0.002 / 0.999 from {} units; worst error / proven bound {:.3}",
            self.admissions, self.total, self.worst_error, self.min_jain, self.guaranteed_from, self.bound_ratio
        )
    }
}

/// Checks the admitted sequence against the scheduler's proportional-share law: on every
/// prefix of `T` units, tenant `i`'s share is within `max(M_i, w_i·ΣM/Σw) / T` of
/// `w_i / Σw`; past the guaranteed length, the error is below 0.002 and Jain's index over
/// cost/weight at least 0.999. Figures are the worst over prefixes of at least 100,000.
fn check_shares(admitted: &[Job], weights: &[u32], max_costs: &[u64]) -> Shares {
    let n = weights.len();
    let w_sum: f64 = weights.iter().map(|&w| f64::from(w)).sum();
    let m_sum: f64 = max_costs.iter().map(|&m| m as f64).sum();
    let bound: Vec<f64> = (0..n).map(|i| (max_costs[i] as f64).max(f64::from(weights[i]) * m_sum / w_sum)).collect();
    let from = guaranteed_from(weights, max_costs);
    let mut out = Shares { min_jain: 1.0, guaranteed_from: from, ..Shares::default() };
    let mut cost = vec![0u64; n];
    for &(i, c) in admitted {
        cost[i as usize] += c;
        out.total += c;
        out.admissions += 1;
        let t = out.total as f64;
        let (mut error, mut sum, mut sum_sq) = (0.0f64, 0.0, 0.0);
        for j in 0..n {
            let w = f64::from(weights[j]);
            let e = (cost[j] as f64 / t - w / w_sum).abs();
            let ratio = e * t / bound[j];
            assert!(ratio <= 1.0 + 1e-9, "tenant {j}: share error {e} above its bound {} at {t}", bound[j] / t);
            out.bound_ratio = out.bound_ratio.max(ratio);
            error = error.max(e);
            let x = cost[j] as f64 / w;
            sum += x;
            sum_sq += x * x;
        }
        let jain = sum * sum / (n as f64 * sum_sq);
        if out.total >= 100_000 {
            out.worst_error = out.worst_error.max(error);
            out.min_jain = out.min_jain.min(jain);
        }
        if out.total >= from {
            assert!(error < 0.002, "share error {error} at {t}");
            assert!(jain >= 0.999, "Jain index {jain} at {t}");
        }
    }
    assert!(out.total >= 2 * from, "the run must go past the guaranteed length");
    out
}

const WEIGHTS: [u32; 5] = [1, 2, 3, 5, 9];
const MAX_COSTS: [u64; 5] = [100, 30, 100, 60, 10];

#[tokio::test(start_paused = true)]
async fn slots_are_shared_by_weight() {
    let slots = 2;
    let target = 2 * guaranteed_from(&WEIGHTS, &MAX_COSTS) + slots as u64 * 100;
    let fair = FairQueueLayer::concurrency(config(&WEIGHTS), slots).unwrap().key(keys()).cost(costs());
    let (log, reached) = (Log::default(), Arc::new(Notify::new()));
    let svc = ServiceBuilder::new().layer(fair.clone()).service(recorder(
        log.clone(),
        target,
        reached.clone(),
        Duration::from_millis(1),
    ));
    // Each tenant keeps more requests outstanding than it can have in flight, so it is
    // always backlogged when a slot frees.
    keep_backlogged(svc, reached, &MAX_COSTS, 2 * slots + 2, 7).await;
    let log: Vec<Job> = log.lock().unwrap().iter().map(|(job, _)| *job).collect();
    // The first `slots` requests found the queue empty and skipped it (uncharged, as the
    // scheduler allows); from then on the admissions are the scheduler's.
    let shares = check_shares(&log[slots..], &WEIGHTS, &MAX_COSTS);
    eprintln!("through the layer, {slots} slots, weights {WEIGHTS:?}, costs up to {MAX_COSTS:?}: {shares}");
    assert_eq!(fair.stats().refused.total(), 0);
}

/// Priority bands through the layer: one slot; tenant 2 sends batch work (band 1, a
/// fifth kept while it waits), tenants 0 and 1 interactive work (band 0, weights 1 and
/// 3). Interactive goes first, batch keeps a fifth of the slot's turns, and inside the
/// interactive band the weights hold.
#[tokio::test(start_paused = true)]
async fn bands_go_in_order_and_a_lower_band_keeps_its_minimum_share() {
    let queue = config(&[1, 3, 1]).band("interactive", 0).band("batch", 20);
    let fair = FairQueueLayer::concurrency(queue, 1)
        .unwrap()
        .key(keys())
        .band(|job: &Job| (job.0 == 2).then_some(1))
        .cost(costs());
    let log = Log::default();
    let svc = ServiceBuilder::new().layer(fair.clone()).service(recorder(
        log.clone(),
        u64::MAX,
        Arc::new(Notify::new()),
        Duration::from_millis(1),
    ));
    let mut calls = JoinSet::new();
    // The batch tenant arrives first and takes the free slot; then everyone queues.
    for tenant in std::iter::once(2).chain((0..60).map(|i| [2, 0, 1][i % 3])) {
        let mut svc = svc.clone();
        let call = svc.ready().await.unwrap().call((tenant, 1));
        calls.spawn(call);
        settle().await;
    }
    while let Some(done) = calls.join_next().await {
        done.unwrap().unwrap();
    }
    let order: Vec<u32> = log.lock().unwrap().iter().map(|((t, _), _)| *t).collect();
    // After the first (which found the slot free), while both bands wait: 40 interactive
    // requests and a fifth of the turns to batch, i.e. 10 batch requests in the first 50.
    let first_50 = &order[1..51];
    let batch = first_50.iter().filter(|&&t| t == 2).count();
    assert_eq!(batch, 10, "{order:?}");
    assert_eq!(first_50.iter().filter(|&&t| t != 2).count(), 40);
    // Inside the interactive band, weights 1 and 3 while both tenants wait (the heavy
    // one's 20 requests last about 25 turns).
    let count = |t: u32| order[1..26].iter().filter(|&&x| x == t).count();
    assert!(count(1).abs_diff(3 * count(0)) <= 3, "weights 1 and 3 inside the band: {order:?}");
    // Then the rest of the batch band.
    assert!(order[51..].iter().all(|&t| t == 2), "{order:?}");
}

/// A fleet replica's layer with two bands (the second keeping 20%) over a rate of one a
/// second with a burst of two, and its calls: tenant 1 takes both tokens; tenant 0's
/// first request waits at the gate, two more queue in the first band (cost 1) and one in
/// the second (cost 2).
async fn banded_fleet_replica() -> (Arc<tower_limits::core::FleetShares>, JoinSet<Result<(), BoxError>>) {
    let fleet = Arc::new(tower_limits::core::FleetShares::new());
    let queue = config(&[1, 1]).band("interactive", 0).band("batch", 20);
    let fair = FairQueueLayer::rate(queue, bucket(Quota::per_second(nz!(1)).burst(nz!(2))))
        .unwrap()
        .fleet(fleet.clone())
        .key(keys())
        .band(|job: &Job| (job.1 == 2).then_some(1))
        .cost(costs());
    let svc = ServiceBuilder::new().layer(fair).service(tower::service_fn(|_: Job| async { Ok::<_, BoxError>(()) }));
    let mut calls = JoinSet::new();
    for job in [(1, 2), (0, 1), (0, 1), (0, 1), (0, 2)] {
        let mut svc = svc.clone();
        let call = svc.ready().await.unwrap().call(job);
        calls.spawn(call);
        settle().await;
    }
    (fleet, calls)
}

/// A tenant waiting in two bands is one tenant to the fleet: the backlog the layer
/// publishes (when a request reaches the rate's gate) names it once, with all its
/// waiting requests.
#[tokio::test(start_paused = true)]
async fn a_tenant_in_two_bands_is_published_to_the_fleet_once() {
    let (fleet, mut calls) = banded_fleet_replica().await;
    // A second later the gate admits it, and the next request of the first band takes
    // its place: the backlog is published.
    tokio::time::advance(Duration::from_millis(1_000)).await;
    settle().await;
    let waiting: Vec<(String, u64)> = fleet.demand().iter().map(|d| (d.key.to_string(), d.waiting)).collect();
    assert_eq!(waiting.iter().filter(|(k, _)| k == "t0").count(), 1, "{waiting:?}");
    assert!(waiting.contains(&("t0".to_owned(), 3)), "{waiting:?}");
    // With the bands it waits in, the bands' minimum shares and the gate's band.
    let t0 = fleet.demand().into_iter().find(|d| d.key.to_string() == "t0").unwrap();
    assert_eq!(t0.bands, 0b11);
    assert_eq!((fleet.min_shares(), fleet.band()), (vec![0, 20], 0));
    calls.abort_all();
}

/// A fleet's store orders the bands: when it names one, the layer dispatches from it
/// next, though an earlier band has requests queued.
#[tokio::test(start_paused = true)]
async fn the_layer_dispatches_from_the_band_the_fleet_names() {
    let (fleet, mut calls) = banded_fleet_replica().await;
    // The store asks for the batch band: the gate's next request is the batch one.
    fleet.set_next_band(Some(1));
    tokio::time::advance(Duration::from_millis(1_000)).await;
    settle().await;
    assert_eq!(fleet.band(), 1, "{fleet:?}");
    // Nothing left in the batch band: back to the queue's own order.
    tokio::time::advance(Duration::from_millis(2_000)).await;
    settle().await;
    assert_eq!(fleet.band(), 0, "{fleet:?}");
    calls.abort_all();
}

/// A fleet's store that leases capacity per band names each band's share of this
/// replica's dispatches; the layer keeps those, not the configured ones (with its 20%,
/// the batch request would go second).
#[tokio::test(start_paused = true)]
async fn the_layer_keeps_the_band_shares_the_fleet_names() {
    let (fleet, mut calls) = banded_fleet_replica().await;
    fleet.set_band_shares(Some(vec![0, 0]));
    for _ in 0..2 {
        tokio::time::advance(Duration::from_millis(1_000)).await;
        settle().await;
        assert_eq!(fleet.band(), 0, "{fleet:?}");
    }
    calls.abort_all();
}

#[tokio::test(start_paused = true)]
async fn a_rate_is_shared_by_weight_and_never_exceeded() {
    let (rate, burst) = (1_000, 100);
    let target = 2 * guaranteed_from(&WEIGHTS, &MAX_COSTS) + 100;
    let fair = FairQueueLayer::rate(config(&WEIGHTS), bucket(quota(rate, Duration::from_secs(1), burst)))
        .unwrap()
        .key(keys())
        .cost(costs());
    // Start with an empty bucket: the first request goes to the rate gate, everyone
    // else queues behind it.
    let drained = fair.backend().acquire_grant(&TenantKey::global(), burst, fair.now()).unwrap();
    fair.backend().release_grant(&TenantKey::global(), drained);
    let (log, reached) = (Log::default(), Arc::new(Notify::new()));
    let svc = ServiceBuilder::new().layer(fair.clone()).service(recorder(
        log.clone(),
        target,
        reached.clone(),
        Duration::ZERO,
    ));
    keep_backlogged(svc, reached, &MAX_COSTS, 6, 11).await;
    let log = log.lock().unwrap().clone();
    // The rate cap: by every admission, at most rate·t was admitted (the bucket started
    // empty).
    let mut admitted = 0;
    for &((_, cost), at) in &log {
        admitted += cost;
        assert!(admitted as f64 <= rate as f64 * at.as_secs_f64() + 1e-6, "{admitted} by {at:?}");
    }
    // Work-conserving: each admission happens at the exact instant its cost is refilled
    // (1 token a millisecond), never later.
    let mut refilled_at = Duration::ZERO;
    for &((_, cost), at) in &log {
        refilled_at += Duration::from_millis(cost);
        assert_eq!(at, refilled_at, "admitted at the instant the bucket holds its cost");
    }
    let jobs: Vec<Job> = log.iter().map(|(job, _)| *job).collect();
    // The first request skipped the (empty) queue to the gate, uncharged.
    let shares = check_shares(&jobs[1..], &WEIGHTS, &MAX_COSTS);
    eprintln!("through the layer, rate {rate}/s, weights {WEIGHTS:?}, costs up to {MAX_COSTS:?}: {shares}");
}

// ---------------------------------------------------------------------------------------
// Work conservation, timers, no herd
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn slots_never_idle_while_requests_queue() {
    let slots = 3;
    let total = 60;
    let fair = FairQueueLayer::concurrency(config(&[1, 2, 3]), slots).unwrap().key(keys()).cost(costs());
    let (inner, mut handle) = mock::pair::<Job, ()>();
    handle.allow(1_000);
    let mut svc = tower::Layer::layer(&fair, inner);
    let mut calls = JoinSet::new();
    for k in 0..total {
        calls.spawn(svc.ready().await.unwrap().call((k % 3, 1 + u64::from(k) % 7)));
    }
    let start = TokioInstant::now();
    let mut running = VecDeque::new();
    let mut remaining = total as usize;
    while remaining > 0 {
        // Every freed slot is taken at once: the next request reaches the inner service
        // with no time passing (a lost wake-up would run into the timeout).
        while running.len() < slots.min(remaining) {
            let (_, send) = timeout(Duration::from_secs(1), handle.next_request()).await.unwrap().unwrap();
            running.push_back(send);
        }
        assert_eq!(start.elapsed(), Duration::ZERO);
        let stats = fair.stats();
        assert!(stats.queued == 0 || stats.in_flight == slots, "{stats:?}");
        assert_eq!(stats.queued, remaining - running.len());
        running.pop_front().unwrap().send_response(());
        remaining -= 1;
    }
    calls.join_all().await.into_iter().for_each(|r| r.unwrap());
    let stats = fair.stats();
    assert_eq!((stats.in_flight, stats.queued, stats.admitted), (0, 0, u64::from(total)));
}

/// Counts the polls of a future.
struct Counted<F> {
    inner: Pin<Box<F>>,
    polls: Arc<AtomicUsize>,
}

impl<F: Future> Future for Counted<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.polls.fetch_add(1, Ordering::SeqCst);
        self.inner.as_mut().poll(cx)
    }
}

#[tokio::test(start_paused = true)]
async fn the_rate_gate_wakes_one_waiter_at_the_exact_instant() {
    let n = 20;
    let fair = FairQueueLayer::rate(config(&[1, 1]), bucket(Quota::per_second(nz!(10)).burst(nz!(1))))
        .unwrap()
        .key(keys())
        .cost(costs());
    let (log, reached) = (Log::default(), Arc::new(Notify::new()));
    let mut svc =
        ServiceBuilder::new().layer(fair.clone()).service(recorder(log.clone(), u64::MAX, reached, Duration::ZERO));
    let polls = Arc::new(AtomicUsize::new(0));
    let mut calls = JoinSet::new();
    for k in 0..n {
        let fut = svc.ready().await.unwrap().call((k % 2, 1));
        calls.spawn(Counted { inner: Box::pin(fut), polls: polls.clone() });
    }
    timeout(Duration::from_secs(60), calls.join_all()).await.unwrap().into_iter().for_each(|r| r.unwrap());
    let instants: Vec<Duration> = log.lock().unwrap().iter().map(|(_, at)| *at).collect();
    let expected: Vec<Duration> = (0..u64::from(n)).map(|k| Duration::from_millis(100 * k)).collect();
    assert_eq!(instants, expected, "one admission at each instant a token is refilled, exactly");
    // Each waiter is polled when it queues, when it reaches the gate (to arm its timer)
    // and when its timer fires: a herd would poll every waiter at every instant.
    let polls = polls.load(Ordering::SeqCst);
    eprintln!("{n} requests through the rate gate: {polls} polls");
    assert!(polls <= 3 * n as usize, "{polls} polls for {n} requests");
}

#[tokio::test(start_paused = true)]
async fn dropping_the_request_at_the_gate_hands_the_timer_on() {
    for polls_before_drop in 0..3 {
        let fair = FairQueueLayer::rate(config(&[1, 1]), bucket(Quota::per_second(nz!(10)).burst(nz!(1))))
            .unwrap()
            .key(keys())
            .cost(costs());
        let (log, reached) = (Log::default(), Arc::new(Notify::new()));
        let mut svc =
            ServiceBuilder::new().layer(fair.clone()).service(recorder(log.clone(), u64::MAX, reached, Duration::ZERO));
        svc.ready().await.unwrap().call((0, 1)).await.unwrap(); // the bucket is empty now
        let mut gate = Box::pin(svc.ready().await.unwrap().call((0, 1))); // at the gate until 100 ms
        // The next request waits in its own task: only a wake-up makes it look again.
        let next = tokio::spawn(svc.ready().await.unwrap().call((1, 1)));
        settle().await;
        for _ in 0..polls_before_drop {
            assert!(poll_once(&mut gate).await.is_pending());
        }
        assert!(fair.stats().waiting_for_rate);
        tokio::time::advance(Duration::from_millis(50)).await;
        drop(gate);
        let start = TokioInstant::now();
        timeout(Duration::from_secs(10), next).await.expect("the next request took the timer").unwrap().unwrap();
        assert_eq!(start.elapsed(), Duration::from_millis(50), "at 100 ms, when its token is there");
        let stats = fair.stats();
        assert_eq!((stats.cancelled, stats.queued, stats.in_flight, stats.waiting_for_rate), (1, 0, 0, false));
        assert_eq!(log.lock().unwrap().iter().map(|((t, _), _)| *t).collect::<Vec<_>>(), [0, 1]);
    }
}

#[tokio::test(start_paused = true)]
async fn a_semaphore_in_the_backend_is_waited_on_and_retried_at_release() {
    let set = LimitSet::new(LimitSetPolicy::new().limit(LimitPolicy::semaphore("upstream", 1))).unwrap();
    let fair = FairQueueLayer::rate(config(&[1, 1]), set).unwrap().key(keys()).cost(costs());
    let (inner, mut handle) = mock::pair::<Job, ()>();
    handle.allow(100);
    let mut svc = tower::Layer::layer(&fair, inner);
    let first = tokio::spawn(svc.ready().await.unwrap().call((0, 1)));
    let second = tokio::spawn(svc.ready().await.unwrap().call((1, 1)));
    let (_, send) = handle.next_request().await.unwrap();
    settle().await;
    assert!(fair.stats().waiting_for_rate);
    let start = TokioInstant::now();
    send.send_response(());
    first.await.unwrap().unwrap();
    let (job, send) = timeout(Duration::from_secs(1), handle.next_request()).await.unwrap().unwrap();
    assert_eq!((job, start.elapsed()), ((1, 1), Duration::ZERO), "retried at the release");
    send.send_response(());
    second.await.unwrap().unwrap();
    assert_eq!(fair.backend().stats().limits[0].held, 0);
}

// ---------------------------------------------------------------------------------------
// Queue limits, refusals and their answers
// ---------------------------------------------------------------------------------------

fn http_request(tenant: &str) -> http::Request<String> {
    let mut req = http::Request::new(String::new());
    req.extensions_mut().insert(TenantKey::single(tenant).unwrap());
    req
}

/// Calls `svc` once it is ready with a request of `tenant`, and runs the response
/// future as a task.
async fn spawn_call<S>(svc: &mut S, tenant: &str) -> tokio::task::JoinHandle<Result<S::Response, S::Error>>
where
    S: Service<http::Request<String>>,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Send + 'static + std::fmt::Debug,
{
    tokio::spawn(svc.ready().await.unwrap().call(http_request(tenant)))
}

#[tokio::test(start_paused = true)]
async fn full_queues_answer_429_and_503() {
    let config = FairQueueConfig::new().tenant_queue_limit(2).global_queue_limit(3);
    // No suggested wait for unknown ones: the test reads the pace-based estimate alone.
    let fair = FairQueueLayer::concurrency(config, 1)
        .unwrap()
        .key(FromExtension::<TenantKey>::new())
        .refuse_with(HttpAnswer::new().with_unknown_wait(None));
    let (inner, mut handle) = mock::pair::<http::Request<String>, http::Response<String>>();
    handle.allow(100);
    let svc = &mut tower::Layer::layer(&fair, inner);

    // "a" keeps two requests queued while it is served one a second, so that its pace
    // is known.
    let mut answers = vec![spawn_call(svc, "a").await, spawn_call(svc, "a").await, spawn_call(svc, "a").await];
    let full = spawn_call(svc, "a").await.await.unwrap().unwrap();
    assert_eq!(full.status(), 429, "its own queue is full");
    assert!(full.headers().get("retry-after").is_none(), "its pace is not known yet");
    for _ in 0..2 {
        let (_, send) = handle.next_request().await.unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
        send.send_response(http::Response::new(String::new()));
        settle().await;
        answers.push(spawn_call(svc, "a").await);
    }
    let full = spawn_call(svc, "a").await.await.unwrap().unwrap();
    assert_eq!(full.status(), 429);
    assert_eq!(full.headers()["retry-after"], "1", "its next admission is due in a second");

    answers.push(spawn_call(svc, "b").await); // the third queued request: the whole queue is full
    let full = spawn_call(svc, "c").await.await.unwrap().unwrap();
    assert_eq!(full.status(), 503, "shared overload");
    let stats = fair.stats();
    assert_eq!((stats.refused.tenant_queue_full, stats.refused.queue_full), (2, 1));
    let a = fair.tenant_stats(&TenantKey::single("a").unwrap()).unwrap();
    assert_eq!((a.queued, a.admitted, a.waited), (2, 3, 2));

    drop(handle); // the inner service closes: the rest fail with its error
    for answer in answers {
        let _ = answer.await.unwrap();
    }
    assert_eq!((fair.stats().in_flight, fair.stats().queued), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn waiters_time_out_after_the_maximum_queueing_time() {
    let fair = FairQueueLayer::concurrency(config(&[1, 1]), 1)
        .unwrap()
        .key(keys())
        .cost(costs())
        .max_queue_time(Duration::from_secs(5));
    let (inner, mut handle) = mock::pair::<Job, ()>();
    handle.allow(100);
    let mut svc = tower::Layer::layer(&fair, inner);
    let held = svc.ready().await.unwrap().call((0, 1));
    let start = TokioInstant::now();
    let b = svc.ready().await.unwrap().call((0, 1));
    let c = tokio::spawn(svc.ready().await.unwrap().call((1, 1)));
    tokio::time::advance(Duration::from_secs(2)).await;
    let d = svc.ready().await.unwrap().call((1, 1));
    let err = b.await.unwrap_err();
    assert_eq!(limit_error(&err).kind(), ErrorKind::WaitTimedOut);
    assert_eq!(limit_error(&err).status(), 503);
    assert_eq!(start.elapsed(), Duration::from_secs(5), "at its deadline exactly");
    assert_eq!(limit_error(&c.await.unwrap().unwrap_err()).kind(), ErrorKind::WaitTimedOut);
    assert_eq!(fair.stats().queued, 1, "d still waits");
    let err = d.await.unwrap_err();
    assert_eq!((limit_error(&err).kind(), start.elapsed()), (ErrorKind::WaitTimedOut, Duration::from_secs(7)));
    drop(held);
    let stats = fair.stats();
    assert_eq!((stats.refused.wait_timed_out, stats.queued, stats.in_flight), (3, 0, 0));
}

#[tokio::test(start_paused = true)]
async fn a_rate_instant_past_the_deadline_is_refused_at_once() {
    let fair = FairQueueLayer::rate(config(&[1]), bucket(Quota::per_second(nz!(1))))
        .unwrap()
        .key(keys())
        .cost(costs())
        .max_queue_time(Duration::from_millis(500));
    let svc =
        ServiceBuilder::new().layer(fair.clone()).service(tower::service_fn(|_: Job| async { Ok::<_, BoxError>(()) }));
    svc.clone().oneshot((0, 1)).await.unwrap();
    let start = TokioInstant::now();
    let err = svc.oneshot((0, 1)).await.unwrap_err();
    let err = limit_error(&err);
    assert_eq!(
        (err.kind(), err.limit(), err.retry_after()),
        (ErrorKind::WaitTimedOut, Some("tokens"), Some(Duration::from_secs(1)))
    );
    assert_eq!(start.elapsed(), Duration::ZERO, "no waiting for a wait that cannot fit");
    assert!(!fair.stats().waiting_for_rate);
}

#[tokio::test(start_paused = true)]
async fn a_tenants_own_limit_in_the_backend_refuses_at_its_turn_and_the_next_goes_on() {
    let set =
        LimitSet::new(LimitSetPolicy::new().tiers(["tenant"]).limit(
            LimitPolicy::token_bucket("own", Quota::per_hour(nz!(1)).burst(nz!(5))).per("tenant").counting_cost(),
        ))
        .unwrap();
    let fair = FairQueueLayer::rate_and_concurrency(config(&[1, 1]), set, 1).unwrap().key(keys()).cost(costs());
    let (inner, mut handle) = mock::pair::<Job, ()>();
    handle.allow(100);
    let mut svc = tower::Layer::layer(&fair, inner);
    let first = tokio::spawn(svc.ready().await.unwrap().call((0, 4)));
    let over = tokio::spawn(svc.ready().await.unwrap().call((0, 4))); // t0 has 1 token left
    let other = tokio::spawn(svc.ready().await.unwrap().call((1, 4)));
    let (_, send) = handle.next_request().await.unwrap();
    send.send_response(());
    first.await.unwrap().unwrap();
    let err = over.await.unwrap().unwrap_err();
    assert_eq!((limit_error(&err).kind(), limit_error(&err).status().as_u16()), (ErrorKind::RateLimited, 429));
    let (job, send) = handle.next_request().await.unwrap();
    assert_eq!(job, (1, 4));
    send.send_response(());
    other.await.unwrap().unwrap();
    assert_eq!(fair.stats().refused.rate_limited, 1);
}

#[tokio::test(start_paused = true)]
async fn keys_weights_and_defaults() {
    let config = FairQueueConfig::new().default_weight(2).weight("acme/alice", 5).weight("globex", 3);
    let fair = FairQueueLayer::concurrency(config, 1).unwrap();
    assert_eq!(fair.weight_of(&TenantKey::new(["acme", "alice"]).unwrap()), 5, "named by its Display form");
    assert_eq!(fair.weight_of(&TenantKey::single("acme").unwrap()), 2);
    assert_eq!(fair.weight_of(&TenantKey::single("globex").unwrap()), 3);
    let bad = FairQueueConfig::new().weight("a/b/c/d/e/f/g/h/i", 2);
    assert!(FairQueueLayer::concurrency(bad, 1).unwrap_err().to_string().starts_with("weights[\"a/b/c/d/e/f/g/h/i\"]"));
    assert!(FairQueueLayer::concurrency(FairQueueConfig::new(), 0).is_err());
    assert!(FairQueueLayer::concurrency(FairQueueConfig::new().default_weight(0), 1).is_err());

    let keyed = FairQueueLayer::concurrency(FairQueueConfig::new(), 1)
        .unwrap()
        .key(KeyFn::new(|r: &Option<&'static str>| r.map(|t| TenantKey::single(t).unwrap())));
    let svc = ServiceBuilder::new()
        .layer(keyed.clone())
        .service(tower::service_fn(|_: Option<&'static str>| async { Ok::<_, BoxError>(()) }));
    let err = svc.clone().oneshot(None).await.unwrap_err();
    assert_eq!(limit_error(&err).kind(), ErrorKind::MissingKey);
    let anonymous = TenantKey::single("anonymous").unwrap();
    let defaulted = keyed.clone().default_key(anonymous.clone());
    let svc = ServiceBuilder::new()
        .layer(defaulted.clone())
        .service(tower::service_fn(|_: Option<&'static str>| async { Ok::<_, BoxError>(()) }));
    svc.oneshot(None).await.unwrap();
    assert_eq!(defaulted.tenant_stats(&anonymous).unwrap().admitted, 1);
    assert_eq!(keyed.stats().refused.missing_key, 1);
}

#[tokio::test(start_paused = true)]
async fn poll_ready_forwards_the_inner_readiness_and_reserves_nothing() {
    let fair = FairQueueLayer::concurrency(FairQueueConfig::new(), 1).unwrap();
    let (inner, mut handle) = mock::pair::<u64, u64>();
    let mut svc = tower_test::mock::Spawn::new(tower::Layer::layer(&fair, inner));
    handle.allow(0);
    assert!(svc.poll_ready().is_pending(), "not ready while the inner service is not");
    handle.allow(10);
    for _ in 0..5 {
        let mut clone = tower_test::mock::Spawn::new(svc.get_ref().clone());
        assert!(clone.poll_ready().is_ready());
    }
    assert_eq!(fair.stats().in_flight, 0, "readiness holds no slot");
    assert!(svc.poll_ready().is_ready());
    let fut = svc.call(7);
    let (req, send) = handle.next_request().await.unwrap();
    assert_eq!(req, 7);
    send.send_response(70);
    assert_eq!(fut.await.unwrap(), 70);
}

// ---------------------------------------------------------------------------------------
// Cancellation
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn dropped_queued_requests_leave_the_queue() {
    for polls in 0..2 {
        let fair = FairQueueLayer::concurrency(config(&[1, 1, 1]), 1).unwrap().key(keys()).cost(costs());
        let (inner, mut handle) = mock::pair::<Job, ()>();
        handle.allow(100);
        let mut svc = tower::Layer::layer(&fair, inner);
        let held = svc.ready().await.unwrap().call((0, 1));
        let mut queued = Vec::new();
        for (i, job) in [(0, 2), (1, 3), (0, 4), (2, 5)].into_iter().enumerate() {
            let mut fut = svc.ready().await.unwrap().call(job);
            for _ in 0..polls {
                assert!(poll_once(&mut fut).await.is_pending(), "{i}");
            }
            queued.push(Some(fut));
        }
        drop(queued[1].take()); // behind the head
        drop(queued[0].take()); // the head of the queue
        let stats = fair.stats();
        assert_eq!((stats.queued, stats.cancelled, stats.in_flight), (2, 2, 1));
        let rest: Vec<_> = queued.into_iter().flatten().map(tokio::spawn).collect();
        let (job, _first) = handle.next_request().await.unwrap();
        assert_eq!(job, (0, 1));
        drop(held); // the slot comes back: the next tenant goes
        let (job, send) = timeout(Duration::from_secs(1), handle.next_request()).await.unwrap().unwrap();
        assert_eq!(job, (0, 4), "t0 and t2 start level; t0 queued first");
        send.send_response(());
        let (job, send) = timeout(Duration::from_secs(1), handle.next_request()).await.unwrap().unwrap();
        assert_eq!(job, (2, 5));
        send.send_response(());
        for r in rest {
            let _ = r.await.unwrap();
        }
        assert_eq!((fair.stats().in_flight, fair.stats().queued), (0, 0));
    }
}

#[tokio::test(start_paused = true)]
async fn a_request_dropped_right_after_its_grant_gives_everything_back() {
    let fair = FairQueueLayer::rate_and_concurrency(config(&[1, 1]), bucket(Quota::per_hour(nz!(1)).burst(nz!(10))), 1)
        .unwrap()
        .key(keys())
        .cost(costs());
    let (inner, mut handle) = mock::pair::<Job, ()>();
    handle.allow(100);
    let mut svc = tower::Layer::layer(&fair, inner);
    let first = svc.ready().await.unwrap().call((0, 3));
    let granted = svc.ready().await.unwrap().call((0, 4));
    let next = svc.ready().await.unwrap().call((1, 2));
    assert_eq!(tokens_left(fair.backend()), 7);
    let (_, send) = handle.next_request().await.unwrap();
    send.send_response(());
    first.await.unwrap();
    // The slot went to `granted` (its tokens taken); it has not been polled since.
    let stats = fair.stats();
    assert_eq!((stats.in_flight, stats.queued), (1, 1));
    assert_eq!(tokens_left(fair.backend()), 3);
    drop(granted);
    // Its tokens and its slot came back, and the next tenant was dispatched at once.
    assert_eq!(tokens_left(fair.backend()), 10 - 3 - 2);
    let stats = fair.stats();
    assert_eq!((stats.in_flight, stats.queued, stats.cancelled, stats.admitted), (1, 0, 1, 1));
    let next = tokio::spawn(next);
    let (job, send) = handle.next_request().await.unwrap();
    assert_eq!(job, (1, 2));
    send.send_response(());
    next.await.unwrap().unwrap();
    let stats = fair.stats();
    assert_eq!((stats.in_flight, stats.queued, stats.admitted, stats.admitted_cost), (0, 0, 2, 5));
}

#[tokio::test(start_paused = true)]
async fn a_called_request_dropped_releases_its_slot_and_keeps_its_cost() {
    let fair = FairQueueLayer::rate_and_concurrency(config(&[1, 1]), bucket(Quota::per_hour(nz!(1)).burst(nz!(10))), 1)
        .unwrap()
        .key(keys())
        .cost(costs());
    let (inner, mut handle) = mock::pair::<Job, ()>();
    handle.allow(100);
    let mut svc = tower::Layer::layer(&fair, inner);
    let mut first = svc.ready().await.unwrap().call((0, 3));
    let next = tokio::spawn(svc.ready().await.unwrap().call((1, 2)));
    assert!(poll_once(&mut first).await.is_pending());
    let _first_request = handle.next_request().await.unwrap();
    drop(first);
    let (job, send) = timeout(Duration::from_secs(1), handle.next_request()).await.unwrap().unwrap();
    assert_eq!(job, (1, 2));
    assert_eq!(tokens_left(fair.backend()), 5, "the dropped call's cost stays charged");
    send.send_response(());
    next.await.unwrap().unwrap();
    assert_eq!(fair.stats().in_flight, 0);
}

#[tokio::test(start_paused = true)]
async fn tenant_counters_are_bounded() {
    let fair =
        FairQueueLayer::concurrency(FairQueueConfig::new(), 1).unwrap().key(keys()).cost(costs()).tracked_tenants(8);
    let svc =
        ServiceBuilder::new().layer(fair.clone()).service(tower::service_fn(|_: Job| async { Ok::<_, BoxError>(()) }));
    for i in 0..100 {
        svc.clone().oneshot((i, 2)).await.unwrap();
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(fair.stats().tracked_tenants <= 8);
        let latest = fair.tenant_stats(&tenant(i)).expect("the latest tenant is kept");
        assert_eq!((latest.admitted, latest.admitted_cost, latest.weight), (1, 2, 1));
    }
    assert_eq!((fair.stats().admitted, fair.stats().admitted_cost), (100, 200), "totals stay exact");
}

/// Random arrivals, answers, drops at every stage and time jumps, through slots, a
/// rate, a semaphore in the backend and a maximum queueing time: every slot and every
/// permit comes back, and every request is accounted for exactly once.
#[tokio::test(start_paused = true)]
async fn nothing_leaks_under_random_arrivals_answers_and_drops() {
    for seed in [0x00c0_ffee, 1, 2] {
        random_run(seed).await;
    }
}

async fn random_run(seed: u64) {
    type Answers = Arc<Mutex<Vec<tokio::sync::oneshot::Sender<()>>>>;
    let set = LimitSet::new(
        LimitSetPolicy::new()
            .limit(LimitPolicy::token_bucket("tokens", Quota::per_second(nz!(1_000)).burst(nz!(40))).counting_cost())
            .limit(LimitPolicy::semaphore("upstream", 3)),
    )
    .unwrap();
    let config = config(&[1, 2, 3, 4, 5]).tenant_queue_limit(6).global_queue_limit(20);
    let fair = FairQueueLayer::rate_and_concurrency(config, set, 4)
        .unwrap()
        .key(keys())
        .cost(costs())
        .max_queue_time(Duration::from_millis(400));
    let answers = Answers::default();
    let pending = answers.clone();
    let called = Arc::new(AtomicU64::new(0));
    let count = called.clone();
    let mut svc = ServiceBuilder::new().layer(fair.clone()).service(tower::service_fn(move |_: Job| {
        let (tx, rx) = tokio::sync::oneshot::channel();
        pending.lock().unwrap().push(tx);
        count.fetch_add(1, Ordering::SeqCst);
        async move { rx.await.map_err(BoxError::from) }
    }));
    let mut rng = Rng(seed);
    type Pending = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send>>;
    let mut futures: Vec<Pending> = Vec::new();
    let mut arrivals = 0u64;
    for step in 0..20_000 {
        match rng.below(10) {
            0..=3 => {
                let cost = if rng.below(50) == 0 { 41 } else { rng.range(1, 40) };
                futures.push(Box::pin(svc.ready().await.unwrap().call((rng.below(5) as u32, cost))));
                arrivals += 1;
            }
            4 | 5 => {
                let mut a = answers.lock().unwrap();
                if !a.is_empty() {
                    let i = rng.below(a.len() as u64) as usize;
                    let _ = a.swap_remove(i).send(());
                }
            }
            6 if !futures.is_empty() => {
                let i = rng.below(futures.len() as u64) as usize;
                drop(futures.swap_remove(i));
            }
            7 | 8 => {
                let mut i = 0;
                while i < futures.len() {
                    if poll_once(&mut futures[i]).await.is_ready() {
                        drop(futures.swap_remove(i));
                    } else {
                        i += 1;
                    }
                }
            }
            _ => tokio::time::advance(Duration::from_millis(rng.below(60))).await,
        }
        let stats = fair.stats();
        assert!(stats.in_flight <= 4 && stats.queued <= 20, "step {step}: {stats:?}");
        assert!(fair.backend().stats().limits[1].held <= 3, "step {step}");
    }
    drop(futures);
    answers.lock().unwrap().clear();
    let stats = fair.stats();
    eprintln!("random run {seed}: {arrivals} arrivals, {} calls, {stats:?}", called.load(Ordering::SeqCst));
    assert_eq!((stats.in_flight, stats.queued, stats.waiting_for_rate), (0, 0, false));
    assert_eq!(fair.backend().stats().limits[1].held, 0, "every backend permit came back");
    assert_eq!(stats.admitted + stats.refused.total() + stats.cancelled, arrivals, "each request counted once");
    assert_eq!(stats.admitted, called.load(Ordering::SeqCst), "admitted means called");
    assert!(stats.max_wait < Duration::from_millis(400), "admitted before its deadline");
    assert!(stats.cancelled > 100 && stats.refused.wait_timed_out > 10 && stats.refused.cost_above_capacity > 10);
    assert!(stats.refused.tenant_queue_full + stats.refused.queue_full > 10);
}
