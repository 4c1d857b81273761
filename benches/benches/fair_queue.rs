//! The weighted-fair queue: one enqueue plus one dispatch, in steady state.
//!
//! `enqueue_pop`: every tenant keeps two requests queued; each iteration dispatches the
//! next request and queues a new one for the same tenant, so the tenant stays
//! backlogged (its heap entry moves down in place).
//!
//! `enqueue_pop_one_each`: every tenant holds one request; each dispatch empties a
//! tenant (it moves to the idle heap) and the enqueue brings it back (off the idle
//! heap, onto the backlogged heap): the heaviest steady path.
//!
//! `enqueue_pop_tenant_key`: as `enqueue_pop`, keyed by `TenantKey` rather than `u64`.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use tower_limits_core::TenantKey;
use tower_limits_core::fair_queue::{FairQueue, FairQueueConfig};

const SIZES: [usize; 3] = [10, 1_000, 10_000];

/// Request costs from 1 to 1000, in a fixed pseudo-random order.
fn costs() -> Vec<u64> {
    let mut x = 0x2545_f491_4f6c_dd1d_u64;
    (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % 1000 + 1
        })
        .collect()
}

fn weight(i: usize) -> u32 {
    (i % 10) as u32 + 1
}

fn steady<K: std::hash::Hash + Eq + Clone>(
    c: &mut Criterion,
    group: &str,
    per_tenant: usize,
    key: impl Fn(usize) -> K,
) {
    let costs = costs();
    let mut g = c.benchmark_group(format!("fair_queue/{group}"));
    for tenants in SIZES {
        let config = FairQueueConfig::new().tenant_queue_limit(4).global_queue_limit(4 * tenants);
        // The item is the tenant's index, standing in for a waker slot.
        let mut q: FairQueue<K, usize> = FairQueue::new(config).unwrap();
        let mut n = 0;
        for i in 0..tenants {
            for _ in 0..per_tenant {
                q.enqueue_weighted(key(i), weight(i), costs[n % costs.len()], i).unwrap();
                n += 1;
            }
        }
        g.bench_with_input(BenchmarkId::from_parameter(tenants), &tenants, |b, _| {
            b.iter(|| {
                let d = q.pop_next().unwrap();
                n += 1;
                let ticket = q.enqueue_weighted(d.key, weight(d.item), costs[n % costs.len()], d.item).unwrap();
                black_box(ticket)
            });
        });
    }
    g.finish();
}

fn bench(c: &mut Criterion) {
    steady(c, "enqueue_pop", 2, |i| i as u64);
    steady(c, "enqueue_pop_one_each", 1, |i| i as u64);
    steady(c, "enqueue_pop_tenant_key", 2, |i| {
        TenantKey::new([format!("org-{}", i % 97), format!("user-{i}")]).unwrap()
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
