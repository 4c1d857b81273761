//! Unit tests of the weighted-fair queue: its order, shares and bounds.

use std::hash::Hash;

use super::lane::Lane;
use super::slab::NONE;
use super::tenant::{FRACTION_BITS, Tenant};
use super::*;

fn queue<T>(tenant: usize, global: usize) -> FairQueue<&'static str, T> {
    FairQueue::new(FairQueueConfig::new().tenant_queue_limit(tenant).global_queue_limit(global)).unwrap()
}

/// Every structural invariant the module relies on, in every band.
fn check<K: Hash + Eq + Clone, T>(q: &FairQueue<K, T>) {
    assert_eq!(q.queued, q.lanes.iter().map(|l| l.queued).sum::<usize>());
    assert!(q.queued <= q.global_limit);
    for (b, lane) in q.lanes.iter().enumerate() {
        check_lane(lane);
        if lane.queued == 0 {
            assert_eq!(q.deficits[b], 0, "an empty band owes nothing");
        }
    }
}

fn check_lane<K: Hash + Eq + Clone, T>(q: &Lane<K, T>) {
    let mut live = 0;
    let mut queued = 0;
    let mut backlogged = 0;
    for (slot, t) in q.tenants.iter().enumerate() {
        let Some(t) = t else { continue };
        live += 1;
        assert!(t.weight >= 1 && t.rem < t.weight);
        assert_eq!(q.table.find(t.hash, |&s| s as usize == slot).copied(), Some(slot as u32));
        let (mut n, mut cost, mut prev, mut at) = (0, 0, NONE, t.head);
        while at != NONE {
            let node = &q.nodes[at as usize];
            assert!(node.item.is_some());
            assert_eq!((node.tenant, node.prev), (slot as u32, prev));
            n += 1;
            cost += node.cost;
            prev = at;
            at = node.next;
        }
        assert_eq!((t.tail, n, t.queued_cost), (prev, t.len, cost));
        queued += n as usize;
        let pos = q.positions[slot] as usize;
        if t.len > 0 {
            backlogged += 1;
            let e = q.backlogged.entries[pos];
            assert_eq!((e.tenant as usize, e.tag, e.seq), (slot, t.tag, q.nodes[t.head as usize].seq));
            assert!(t.tag >= q.vtime);
        } else {
            let e = q.idle.entries[pos];
            assert_eq!((e.tenant as usize, e.tag), (slot, t.ceil_tag()));
            assert!(e.tag > q.vtime, "an idle record whose finish tag was reached");
        }
    }
    assert_eq!((queued, q.queued, live), (q.queued, queued, q.table.len()));
    assert_eq!(backlogged, q.backlogged.entries.len());
    assert_eq!(live - backlogged, q.idle.entries.len());
    assert!(q.idle.entries.len() <= q.global_limit);
    assert!(q.queued <= q.global_limit);
    for heap in [&q.backlogged, &q.idle] {
        for i in 1..heap.entries.len() {
            assert!(!heap.entries[i].before(&heap.entries[(i - 1) / 2]));
        }
    }
    let mut free = 0;
    let mut at = q.free_node;
    while at != NONE {
        assert!(q.nodes[at as usize].item.is_none());
        free += 1;
        at = q.nodes[at as usize].next;
    }
    assert_eq!(free + q.queued, q.nodes.len());
    if q.queued == 0 {
        assert_eq!(live, 0, "an empty queue keeps no record");
    }
}

#[test]
fn weights_share_dispatches() {
    let mut q = queue(100, 200);
    for i in 0..100 {
        q.enqueue_weighted("bulk", 1, 1, i).unwrap();
    }
    for i in 0..20 {
        q.enqueue_weighted("interactive", 3, 1, i).unwrap();
    }
    let order: String = (0..8).map(|_| if q.pop_next().unwrap().key == "bulk" { 'B' } else { 'I' }).collect();
    assert_eq!(order, "BIIIBIII");
    check(&q);
}

#[test]
fn an_idle_record_lives_until_its_finish_tag() {
    let mut q = queue(100, 100);
    q.enqueue_weighted("a", 1, 10, ()).unwrap();
    for _ in 0..20 {
        q.enqueue_weighted("b", 1, 1, ()).unwrap();
    }
    assert_eq!(q.pop_next().unwrap().key, "a"); // F_a = 10
    for i in 0..10 {
        assert_eq!(q.pop_next().unwrap().key, "b"); // starts 0..=9
        assert!(q.tenant_stats(&"a").is_some(), "dropped after {i}");
        check(&q);
    }
    assert_eq!(q.pop_next().unwrap().key, "b"); // starts at 10: V = F_a
    assert_eq!(q.tenant_stats(&"a"), None);
    assert_eq!(q.stats().tracked_tenants, 1);
    check(&q);
    // Back at V = 10, behind b's head that starts at 11.
    q.enqueue_weighted("a", 1, 1, ()).unwrap();
    assert_eq!(q.pop_next().unwrap().key, "a");
}

#[test]
fn an_empty_queue_forgets_everything() {
    let mut q = queue(10, 10);
    let t = q.enqueue_weighted("a", 1, 1000, 1).unwrap();
    q.enqueue_weighted("b", 1, 1, 2).unwrap();
    assert_eq!(q.pop_next().unwrap().ticket, t);
    assert_eq!(q.pop_next().unwrap().item, 2);
    assert_eq!(q.stats().tracked_tenants, 0);
    // a was served 1000 and b 1, but the busy period ended: both start level.
    q.enqueue_weighted("a", 1, 1, 3).unwrap();
    q.enqueue_weighted("b", 1, 1, 4).unwrap();
    assert_eq!(q.pop_next().unwrap().item, 3);
    check(&q);
}

#[test]
fn stale_tickets_touch_nothing() {
    let mut q = queue(10, 10);
    let first = q.enqueue_weighted("a", 1, 1, "first").unwrap();
    q.enqueue_weighted("b", 1, 1, "keep").unwrap();
    assert_eq!(q.pop_next().unwrap().item, "first");
    let second = q.enqueue_weighted("a", 1, 1, "second").unwrap();
    assert_eq!(first.slot, second.slot, "the slot is reused");
    assert_eq!(q.cancel(first), None);
    assert_eq!(q.get(first), None);
    assert_eq!(q.get(second), Some(&"second"));
    *q.get_mut(second).unwrap() = "changed";
    assert_eq!(q.cancel(second), Some("changed"));
    assert_eq!(q.cancel(second), None);
    assert_eq!(q.cancel(Ticket { slot: 1000, seq: 0, band: 0 }), None);
    assert_eq!(q.len(), 1);
    check(&q);
}

#[test]
fn cancelling_the_head_keeps_the_start_tag() {
    let mut q = queue(10, 10);
    q.enqueue_weighted("a", 1, 5, 'x').unwrap();
    let a2 = q.enqueue_weighted("a", 1, 5, 'y').unwrap();
    q.enqueue_weighted("a", 1, 5, 'z').unwrap();
    q.enqueue_weighted("b", 1, 5, 'b').unwrap();
    assert_eq!(q.pop_next().unwrap().item, 'x'); // a's next head starts at 5
    assert_eq!(q.cancel(a2), Some('y'));
    check(&q);
    // b starts at 0 < 5: cancelling gave a nothing.
    assert_eq!(q.pop_next().unwrap().item, 'b');
    assert_eq!(q.pop_next().unwrap().item, 'z');
    assert!(q.pop_next().is_none());
}

#[test]
fn cancelling_the_last_request_keeps_the_finish_tag() {
    let mut q = queue(10, 10);
    q.enqueue_weighted("a", 1, 5, 1).unwrap();
    let a2 = q.enqueue_weighted("a", 1, 5, 2).unwrap();
    q.enqueue_weighted("b", 1, 1, 3).unwrap();
    q.enqueue_weighted("b", 1, 1, 4).unwrap();
    assert_eq!(q.pop_next().unwrap().item, 1);
    assert_eq!(q.cancel(a2), Some(2));
    check(&q);
    assert!(q.tenant_stats(&"a").is_some(), "a still finishes at 5");
    q.enqueue_weighted("a", 1, 1, 5).unwrap();
    let rest: Vec<_> = std::iter::from_fn(|| q.pop_next().map(|d| d.item)).collect();
    assert_eq!(rest, [3, 4, 5]);
}

#[test]
fn remainders_carry() {
    let mut q = queue(10, 10);
    // weight 3, cost 1: a's tags are 0, 1/3, 2/3 and exactly 1, so its fourth request
    // ties with b's second, which arrived first (rounding each third down would put
    // a first).
    q.enqueue_weighted("b", 1, 1, 'b').unwrap();
    q.enqueue_weighted("b", 1, 1, 'b').unwrap();
    for _ in 0..4 {
        q.enqueue_weighted("a", 3, 1, 'a').unwrap();
    }
    let order: String = std::iter::from_fn(|| q.pop_next().map(|d| d.item)).collect();
    assert_eq!(order, "baaaba");
    let mut t = Tenant::new((), 0, 0, 7);
    for _ in 0..7_000 {
        t.advance(3);
    }
    assert_eq!((t.tag, t.rem), (3_000 << FRACTION_BITS, 0));
    t.advance(u64::MAX);
    t.advance(u64::MAX);
    assert!(t.tag > 3_000 << FRACTION_BITS);
    t.tag = u128::MAX - 1;
    t.advance(u64::MAX);
    assert_eq!(t.tag, u128::MAX, "saturates");
}

/// The remainder below a unit is carried across a change of weight, rounded up to the
/// new weight's fractions: 2/3 becomes 4/5, and 2/3 at weight 2 makes a whole unit.
#[test]
fn reweighting_carries_the_remainder() {
    let tenant = |rem: u32, weight: u32| Tenant { rem, ..Tenant::new((), 0, 10, weight) };
    let mut t = tenant(2, 3);
    assert!(!t.reweight(5));
    assert_eq!((t.tag, t.rem, t.weight), (10, 4, 5));
    let mut t = tenant(2, 3);
    assert!(t.reweight(2), "the tag moves by the unit rounded up");
    assert_eq!((t.tag, t.rem, t.weight), (11, 0, 2));
    let mut t = tenant(0, 3);
    assert!(!t.reweight(2));
    assert_eq!((t.tag, t.rem, t.weight), (10, 0, 2));
}

#[test]
fn reweighting_rounds_up() {
    let mut q = queue(10, 10);
    q.enqueue_weighted("a", 3, 1, 1).unwrap();
    q.enqueue_weighted("a", 3, 1, 2).unwrap();
    q.enqueue_weighted("b", 2, 1, 3).unwrap();
    assert_eq!(q.pop_next().unwrap().item, 1); // a's head now starts at 1/3
    q.enqueue_weighted("a", 2, 1, 4).unwrap(); // 1/3 becomes 1/2
    check(&q);
    assert_eq!(q.tenant_stats(&"a").unwrap().weight, 2);
    let order: Vec<_> = std::iter::from_fn(|| q.pop_next().map(|d| d.item)).collect();
    assert_eq!(order, [3, 2, 4]);
    let mut q = queue(10, 10);
    q.enqueue_weighted("a", 0, 1, ()).unwrap();
    assert_eq!(q.tenant_stats(&"a").unwrap().weight, 1, "weight 0 counts as 1");
}

#[test]
fn full_queues_refuse_and_count() {
    let mut q = queue(2, 3);
    q.enqueue_weighted("a", 1, 1, 1).unwrap();
    q.enqueue_weighted("a", 1, 1, 2).unwrap();
    let err = q.enqueue_weighted("a", 1, 1, 3).unwrap_err();
    assert_eq!((err.kind(), err.is_tenant(), err.limit()), (QueueKind::Tenant, true, 2));
    assert_eq!(err.to_string(), "tenant queue is full (2 queued)");
    assert_eq!(err.into_item(), 3);
    q.enqueue_weighted("b", 1, 1, 4).unwrap();
    let err = q.enqueue_weighted("c", 1, 1, 5).unwrap_err();
    assert_eq!((err.kind(), err.limit()), (QueueKind::Global, 3));
    assert_eq!(err.to_string(), "queue is full (3 queued)");
    assert!(format!("{err:?}").contains("Global"));
    assert_eq!(q.tenant_stats(&"c"), None, "a refused tenant leaves no record");
    let err = q.enqueue_weighted("a", 1, 1, 6).unwrap_err();
    assert!(err.is_tenant(), "the tenant's own limit is reported first");
    let stats = q.stats();
    assert_eq!((stats.refused_tenant_full, stats.refused_global_full, stats.enqueued), (2, 1, 3));
    check(&q);
}

#[test]
fn idle_records_are_capped() {
    let mut q = queue(10, 3);
    q.enqueue_weighted("z", 1, 100, ()).unwrap();
    q.enqueue_weighted("z", 1, 100, ()).unwrap();
    assert_eq!(q.pop_next().unwrap().key, "z"); // z stays backlogged at 100
    for k in ["a", "b", "c", "d"] {
        q.enqueue_weighted(k, 1, 5, ()).unwrap();
        assert_eq!(q.pop_next().unwrap().key, k);
        check(&q);
    }
    let stats = q.stats();
    assert_eq!((stats.tracked_tenants, stats.evicted_idle), (4, 1));
    assert_eq!(q.tenant_stats(&"a"), None);
    assert!(q.tenant_stats(&"d").is_some());
}

/// Random operations, every invariant checked after each.
#[test]
fn invariants_hold_under_random_operations() {
    let mut state = 0x5eed_u64;
    let mut next = move |n: u64| {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % n
    };
    let keys = ["a", "b", "c", "d", "e", "f", "g", "h"];
    let mut q = queue(6, 24);
    let mut tickets = Vec::new();
    for _ in 0..20_000 {
        match next(10) {
            0..=4 => {
                let key = keys[next(keys.len() as u64) as usize];
                let weight = next(4) as u32 + u32::from(next(20) == 0) * 1000;
                if let Ok(t) = q.enqueue_weighted(key, weight, next(50), ()) {
                    tickets.push(t);
                }
            }
            5..=7 => {
                let peeked = q.peek_next().map(|n| (*n.key, n.ticket, n.cost));
                let popped = q.pop_next().map(|d| (d.key, d.ticket, d.cost));
                assert_eq!(peeked, popped);
            }
            _ if !tickets.is_empty() => {
                let t = tickets.swap_remove(next(tickets.len() as u64) as usize);
                let _ = q.cancel(t);
            }
            _ => {}
        }
        check(&q);
    }
}
