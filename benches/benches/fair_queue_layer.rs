//! Per-request overhead of the `FairQueueLayer`, polled directly (no runtime scheduling
//! measured), over a `service_fn` that answers at once.
//!
//! - `fair_queue_layer/skip_queue`: nothing queued, a slot free: the request skips the
//!   queue (one lock, no scheduler work). Beside it, the bare service and a
//!   `LimitSetLayer` concurrency limit, for scale.
//! - `fair_queue_layer/backlogged/{10,1000,10000}`: one slot; every tenant keeps two
//!   requests queued (weights 1 to 10, costs 1 to 1000, a weight entry per tenant). Each
//!   iteration is one request's whole life as a task sees it: the request that was
//!   granted is polled (it takes its grant, calls the inner service, which answers at
//!   once; its slot goes back and the next request in fair order is granted and its task
//!   woken), then its tenant sends a new request (`call`: enqueue) and polls it once
//!   (it stores its waker).
//! - `fair_queue_layer/backlogged_with_rate/{10,1000,10000}`: the same with a GCRA rate
//!   (never binding) acquired at each dispatch as well.
//!
//! Run: `cargo bench -p tower-limits-benches --bench fair_queue_layer`.

use std::collections::VecDeque;
use std::future::Future;
use std::hint::black_box;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Wake, Waker};
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use tower::{Layer, Service};
use tower_limits::core::fair_queue::FairQueueConfig;
use tower_limits::extract::{CostFn, KeyFn};
use tower_limits::{Backend, FairQueueLayer, LimitSet, Quota, SemaphoreLayer, TenantKey, nz};

const SIZES: [usize; 3] = [10, 1_000, 10_000];

/// Request costs from 1 to 1000, in a fixed pseudo-random order (as the scheduler's bench).
fn costs() -> Arc<Vec<u64>> {
    let mut x = 0x2545_f491_4f6c_dd1d_u64;
    Arc::new(
        (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % 1000 + 1
            })
            .collect(),
    )
}

/// A request: its tenant and its index in the cost table.
type Req = (u32, u32);

fn bare() -> impl Service<Req, Response = (), Error = std::convert::Infallible, Future: Send> + Clone + Send + 'static {
    tower::service_fn(|_req: Req| std::future::ready(Ok::<_, std::convert::Infallible>(())))
}

/// Wakes by putting its slot's number in the ready list.
struct SlotWaker {
    slot: usize,
    ready: Arc<Mutex<VecDeque<usize>>>,
}

impl Wake for SlotWaker {
    fn wake(self: Arc<Self>) {
        self.ready.lock().unwrap().push_back(self.slot);
    }
}

fn skip_queue(c: &mut Criterion) {
    let mut g = c.benchmark_group("fair_queue_layer/skip_queue");
    let mut cx = Context::from_waker(Waker::noop());
    let mut plain = bare();
    g.bench_function("bare_service_fn", |b| {
        b.iter(|| {
            let _ = plain.poll_ready(&mut cx);
            let mut fut = std::pin::pin!(plain.call((0, 0)));
            black_box(fut.as_mut().poll(&mut cx).is_ready())
        });
    });
    let mut fair = FairQueueLayer::concurrency(FairQueueConfig::new(), 64).unwrap().system_clock().layer(bare());
    g.bench_function("fair_queue_layer", |b| {
        b.iter(|| {
            let _ = fair.poll_ready(&mut cx);
            let mut fut = std::pin::pin!(fair.call((0, 0)));
            black_box(fut.as_mut().poll(&mut cx).is_ready())
        });
    });
    let mut limit = SemaphoreLayer::new(nz!(64)).system_clock().layer(bare());
    g.bench_function("limit_set_concurrency", |b| {
        b.iter(|| {
            let _ = limit.poll_ready(&mut cx);
            let mut fut = std::pin::pin!(limit.call((0, 0)));
            black_box(fut.as_mut().poll(&mut cx).is_ready())
        });
    });
    g.finish();
}

type Layered<B> = FairQueueLayer<tower_limits::extract::Extractors, tower_limits::ReturnError, B>;

/// Calls `svc` with a request of `tenant`; the response future, not yet polled.
fn call<S: Service<Req>>(svc: &mut S, tenant: usize, n: &mut u32) -> Pin<Box<S::Future>> {
    let _ = svc.poll_ready(&mut Context::from_waker(Waker::noop()));
    *n = n.wrapping_add(1);
    Box::pin(svc.call((tenant as u32, *n)))
}

fn backlogged_layer<B: Backend>(c: &mut Criterion, group: &str, make: impl Fn(FairQueueConfig) -> Layered<B>) {
    let costs = costs();
    let mut g = c.benchmark_group(format!("fair_queue_layer/{group}"));
    g.measurement_time(Duration::from_secs(4));
    for tenants in SIZES {
        let keys: Arc<Vec<TenantKey>> =
            Arc::new((0..tenants).map(|i| TenantKey::single(format!("tenant-{i}")).unwrap()).collect());
        let mut config = FairQueueConfig::new().tenant_queue_limit(4).global_queue_limit(4 * tenants);
        for i in 0..tenants {
            config = config.weight(format!("tenant-{i}"), (i % 10) as u32 + 1);
        }
        let cost_table = costs.clone();
        let layer = make(config)
            .system_clock()
            .key(KeyFn::new(move |r: &Req| keys.get(r.0 as usize).cloned()))
            .cost(CostFn::new(move |r: &Req| cost_table[r.1 as usize % cost_table.len()]));
        let mut svc = layer.layer(bare());
        let ready = Arc::new(Mutex::new(VecDeque::new()));
        // Slot `2i` and `2i + 1` are tenant i's two requests.
        let wakers: Vec<Waker> =
            (0..2 * tenants).map(|slot| Waker::from(Arc::new(SlotWaker { slot, ready: ready.clone() }))).collect();
        let mut n = 0u32;
        // The first request takes the slot (not polled yet, so it holds it); the others
        // queue and store their wakers.
        let mut slots: Vec<_> = (0..2 * tenants).map(|slot| call(&mut svc, slot / 2, &mut n)).collect();
        for (slot, fut) in slots.iter_mut().enumerate().skip(1) {
            assert!(fut.as_mut().poll(&mut Context::from_waker(&wakers[slot])).is_pending());
        }
        assert!(slots[0].as_mut().poll(&mut Context::from_waker(&wakers[0])).is_ready());
        slots[0] = call(&mut svc, 0, &mut n);
        assert!(slots[0].as_mut().poll(&mut Context::from_waker(&wakers[0])).is_pending());
        assert_eq!(svc.stats().queued, 2 * tenants - 1);
        g.bench_with_input(BenchmarkId::from_parameter(tenants), &tenants, |b, _| {
            b.iter(|| {
                let slot = ready.lock().unwrap().pop_front().expect("a granted request was woken");
                let done = slots[slot].as_mut().poll(&mut Context::from_waker(&wakers[slot]));
                slots[slot] = call(&mut svc, slot / 2, &mut n);
                let queued = slots[slot].as_mut().poll(&mut Context::from_waker(&wakers[slot]));
                black_box((done.is_ready(), queued.is_pending()))
            });
        });
        let stats = svc.stats();
        assert_eq!((stats.queued, stats.refused.total()), (2 * tenants - 1, 0), "{stats:?}");
    }
    g.finish();
}

fn backlogged(c: &mut Criterion) {
    backlogged_layer(c, "backlogged", |config| FairQueueLayer::concurrency(config, 1).unwrap());
    backlogged_layer(c, "backlogged_with_rate", |config| {
        let rate = LimitSet::new(
            tower_limits::LimitSetPolicy::new()
                .limit(tower_limits::LimitPolicy::gcra("rate", Quota::per_second(nz!(1_000_000_000)))),
        )
        .unwrap();
        FairQueueLayer::rate_and_concurrency(config, rate, 1).unwrap()
    });
}

criterion_group!(benches, skip_queue, backlogged);
criterion_main!(benches);
