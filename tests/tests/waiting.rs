//! Law 24: the waiting machine, on paused tokio time: a release wakes only the waiters of
//! the state it freed, in FIFO order per state, a grant passes the wake-up on, and no
//! wake-up is ever lost, whatever is cancelled when. Law numbers are those of
//! `crates/tower-limits/docs/laws.md`.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use proptest::prelude::*;
use tower::{Service, ServiceExt};
use tower_limits::extract::{CostFn, Extractors, KeyFn};
use tower_limits::{BoxError, ErrorKind, LimitError, LimitPolicy, LimitSetLayer, LimitSetPolicy, TenantKey};
use tower_test::mock;

/// A request: its tenant and its cost.
type Req = (char, u64);

/// A waker that counts how often it is woken.
#[derive(Default)]
struct Counter(AtomicUsize);

impl Wake for Counter {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A future polled by hand with its own counting waker.
struct Probe<F> {
    fut: Pin<Box<F>>,
    wakes: Arc<Counter>,
}

impl<F: Future> Probe<F> {
    fn new(fut: F) -> Self {
        Probe { fut: Box::pin(fut), wakes: Arc::default() }
    }

    fn poll(&mut self) -> Poll<F::Output> {
        let waker = Waker::from(self.wakes.clone());
        self.fut.as_mut().poll(&mut Context::from_waker(&waker))
    }

    fn wakes(&self) -> usize {
        self.wakes.0.load(Ordering::SeqCst)
    }
}

type Keys = KeyFn<fn(&Req) -> Option<TenantKey>, Req>;
type Costs = CostFn<fn(&Req) -> u64, Req>;

fn layer(policy: LimitSetPolicy) -> LimitSetLayer<Extractors<Keys, Costs>> {
    LimitSetLayer::new(policy)
        .expect("a valid policy")
        .key(KeyFn::new((|r: &Req| TenantKey::single(r.0.encode_utf8(&mut [0; 4])).ok()) as fn(&Req) -> _))
        .cost(CostFn::new((|r: &Req| r.1) as fn(&Req) -> u64))
        .wait(Duration::from_secs(3600))
}

fn kind(e: &BoxError) -> ErrorKind {
    e.downcast_ref::<LimitError>().expect("a LimitError").kind()
}

/// Lets spawned tasks and woken futures run.
async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_release_wakes_only_the_waiters_of_the_state_it_freed() {
    let layer =
        layer(LimitSetPolicy::new().tiers(["tenant"]).limit(LimitPolicy::semaphore("per-tenant", 1).per("tenant")));
    let (inner, mut handle) = mock::pair::<Req, u64>();
    handle.allow(10);
    let svc = tower::Layer::layer(&layer, inner);
    let holder_a = tokio::spawn(svc.clone().oneshot(('a', 1)));
    let (_, send_a) = handle.next_request().await.expect("a's holder is called");
    let _holder_b = tokio::spawn(svc.clone().oneshot(('b', 1)));
    let _held_b = handle.next_request().await.expect("b's holder is called");

    let mut waiter_a = Probe::new(svc.clone().oneshot(('a', 1)));
    let mut waiter_b = Probe::new(svc.clone().oneshot(('b', 1)));
    assert!(waiter_a.poll().is_pending());
    assert!(waiter_b.poll().is_pending());
    assert_eq!(layer.layer_stats().waiting, 2);

    send_a.send_response(1);
    holder_a.await.expect("joined").expect("answered");
    assert_eq!(waiter_a.wakes(), 1, "a's release wakes a's waiter");
    assert_eq!(waiter_b.wakes(), 0, "and nobody blocked on b's semaphore");
    assert!(waiter_a.poll().is_pending(), "admitted: now calling the inner service");
    let (req, send) = handle.next_request().await.expect("a's waiter is called");
    assert_eq!(req, ('a', 1));
    send.send_response(2);
    assert!(matches!(waiter_a.poll(), Poll::Ready(Ok(2))));
    assert_eq!(waiter_b.wakes(), 0, "a's second release does not wake b either");
    assert!(waiter_b.poll().is_pending());
}

#[tokio::test(start_paused = true)]
async fn a_large_waiter_keeps_its_place_and_smaller_ones_wait_behind_it() {
    let layer = layer(LimitSetPolicy::new().limit(LimitPolicy::semaphore("slots", 2).counting_cost()));
    let (inner, mut handle) = mock::pair::<Req, u64>();
    handle.allow(10);
    let svc = tower::Layer::layer(&layer, inner);
    let first = tokio::spawn(svc.clone().oneshot(('x', 1)));
    let (_, send_first) = handle.next_request().await.expect("called");
    let second = tokio::spawn(svc.clone().oneshot(('y', 1)));
    let (_, send_second) = handle.next_request().await.expect("called");

    let mut large = Probe::new(svc.clone().oneshot(('z', 2)));
    assert!(large.poll().is_pending());
    let mut small = Probe::new(svc.clone().oneshot(('w', 1)));
    assert!(small.poll().is_pending());

    send_first.send_response(1);
    first.await.expect("joined").expect("answered");
    assert_eq!(large.wakes(), 1, "the head of the state is woken");
    assert!(large.poll().is_pending(), "one slot free: not enough for 2");
    assert_eq!(small.wakes(), 0, "the smaller request behind it is not woken: FIFO");
    assert!(small.poll().is_pending());

    send_second.send_response(2);
    second.await.expect("joined").expect("answered");
    assert_eq!(large.wakes(), 2);
    assert!(large.poll().is_pending(), "admitted: calling the inner service");
    let (req, send) = handle.next_request().await.expect("the large request is called");
    assert_eq!(req, ('z', 2));
    // A grant cannot see how much room it left, so it passes the wake-up on: the next
    // waiter tries once more and parks again, keeping its place.
    assert_eq!(small.wakes(), 1, "one try passed on by the grant");
    assert!(small.poll().is_pending(), "no slot left: parked again");
    send.send_response(3);
    assert!(matches!(large.poll(), Poll::Ready(Ok(3))));
    assert_eq!(small.wakes(), 2, "the large release wakes the small one");
    assert!(small.poll().is_pending(), "granted, calling");
    let (req, _) = handle.next_request().await.expect("the small request is called");
    assert_eq!(req, ('w', 1));
}

#[tokio::test(start_paused = true)]
async fn a_grant_passes_the_wake_up_on_when_room_is_left() {
    let layer = layer(LimitSetPolicy::new().limit(LimitPolicy::semaphore("slots", 2).counting_cost()));
    let (inner, mut handle) = mock::pair::<Req, u64>();
    handle.allow(10);
    let svc = tower::Layer::layer(&layer, inner);
    let holder = tokio::spawn(svc.clone().oneshot(('x', 2)));
    let (_, send_holder) = handle.next_request().await.expect("called");
    let mut one = Probe::new(svc.clone().oneshot(('y', 1)));
    let mut two = Probe::new(svc.clone().oneshot(('z', 1)));
    assert!(one.poll().is_pending());
    assert!(two.poll().is_pending());

    send_holder.send_response(0);
    holder.await.expect("joined").expect("answered");
    assert_eq!((one.wakes(), two.wakes()), (1, 0), "one release, one wake-up");
    assert!(one.poll().is_pending(), "granted, calling");
    assert_eq!(two.wakes(), 1, "the grant left a slot: it woke the next");
    assert!(two.poll().is_pending(), "granted, calling");
    let (a, _) = handle.next_request().await.expect("called");
    let (b, _) = handle.next_request().await.expect("called");
    assert_eq!((a, b), (('y', 1), ('z', 1)), "both admitted on the one release, in order");
}

#[tokio::test(start_paused = true)]
async fn a_dropped_waiter_hands_its_wake_up_to_the_next() {
    let layer = layer(LimitSetPolicy::new().limit(LimitPolicy::semaphore("slots", 1)));
    let (inner, mut handle) = mock::pair::<Req, u64>();
    handle.allow(10);
    let svc = tower::Layer::layer(&layer, inner);
    let holder = tokio::spawn(svc.clone().oneshot(('x', 1)));
    let (_, send_holder) = handle.next_request().await.expect("called");
    let mut first = Probe::new(svc.clone().oneshot(('y', 1)));
    let mut second = Probe::new(svc.clone().oneshot(('z', 1)));
    assert!(first.poll().is_pending());
    assert!(second.poll().is_pending());
    send_holder.send_response(0);
    holder.await.expect("joined").expect("answered");
    assert_eq!((first.wakes(), second.wakes()), (1, 0));
    drop(first);
    assert_eq!(second.wakes(), 1, "the wake-up the dropped waiter held goes to the next");
    assert!(second.poll().is_pending(), "granted, calling");
    let (req, _) = handle.next_request().await.expect("called");
    assert_eq!(req, ('z', 1));
    assert_eq!(layer.layer_stats().waiting, 0);
}

/// The inner service of the random run: holds what it was given for `cost * 10` ms.
async fn hold(r: Req) -> Result<u64, Infallible> {
    tokio::time::sleep(Duration::from_millis(r.1 * 10)).await;
    Ok(r.1)
}

/// One step of a random run.
#[derive(Debug, Clone)]
enum Step {
    /// A request of tenant `tenant` with `cost`; it holds what it gets for `cost * 10` ms.
    Send { tenant: usize, cost: u64 },
    /// Drop the `i`-th request still in flight (waiting or held).
    Drop(usize),
    /// Let time pass.
    Advance(u64),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0..3usize, 1..=2u64).prop_map(|(tenant, cost)| Step::Send { tenant, cost }),
        1 => (0..16usize).prop_map(Step::Drop),
        2 => (1..40u64).prop_map(Step::Advance),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Whatever arrives, leaves or is dropped when, every request that is not dropped is
    /// admitted long before its deadline (a lost wake-up would leave it waiting the full
    /// hour), and every slot comes back.
    #[test]
    fn no_wake_up_is_ever_lost(steps in prop::collection::vec(step(), 1..60)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().expect("runtime");
        rt.block_on(async move {
            let layer = layer(
                LimitSetPolicy::new()
                    .tiers(["tenant"])
                    .limit(LimitPolicy::semaphore("global", 3).counting_cost())
                    .limit(LimitPolicy::semaphore("per-tenant", 2).per("tenant").counting_cost()),
            );
            let svc = tower::Layer::layer(&layer, tower::service_fn(hold));
            let start = tokio::time::Instant::now();
            let mut flying = Vec::new();
            for step in steps {
                match step {
                    Step::Send { tenant, cost } => {
                        let mut svc = svc.clone();
                        let tenant = ['a', 'b', 'c'][tenant];
                        flying.push(tokio::spawn(async move {
                            svc.ready().await.expect("ready");
                            svc.call((tenant, cost)).await
                        }));
                    }
                    Step::Drop(i) => {
                        if !flying.is_empty() {
                            let i = i % flying.len();
                            flying.swap_remove(i).abort();
                        }
                    }
                    Step::Advance(ms) => tokio::time::advance(Duration::from_millis(ms)).await,
                }
                settle().await;
            }
            for f in flying {
                let answer = f.await.expect("not aborted");
                if let Err(e) = &answer {
                    prop_assert!(false, "refused: {:?}", kind(e));
                }
            }
            prop_assert!(start.elapsed() < Duration::from_secs(60), "waited {:?}", start.elapsed());
            prop_assert_eq!(layer.layer_stats().waiting, 0);
            let stats = layer.stats();
            prop_assert_eq!(stats.limits[0].held, 0);
            prop_assert_eq!(stats.limits[1].held, 0);
            Ok(())
        })?;
    }
}
