//! Unit tests of the lock-free one-limit path: its decisions, leases and stripes.

use std::sync::Mutex;

use super::laws::{assert_rate_cap, fast, granted};
use super::lease::*;
use super::stripes::{OWNED_STRIPES, STRIPE, shared_stripe};
use super::*;
use crate::nz;
use crate::rate::Quota;

/// The first two of `limits` that `fit` each other.
fn pair(limits: &[Fast], fit: impl Fn(&Fast, &Fast) -> bool) -> (&Fast, &Fast) {
    for (i, x) in limits.iter().enumerate() {
        if let Some(y) = limits[i + 1..].iter().find(|y| fit(x, y)) {
            return (x, y);
        }
    }
    unreachable!("{} limits over {LEASE_SLOTS} slots hold such a pair", limits.len())
}

#[test]
fn a_lease_is_taken_used_without_a_shared_write_and_given_back() {
    // T = 1us, burst 1,000.
    let f = fast(Quota::per_second(nz!(1_000_000)).burst(nz!(1_000)));
    let now = Instant::from_nanos(5_000_000);
    // A lone thread never leases.
    assert_eq!(granted(f.acquire(1, now)), Some(now.as_nanos()));
    assert_eq!(f.tat(), now.as_nanos() + 1_000);
    f.mark_contended();
    // 998 units of headroom left after this grant: a lease of 64 in all.
    assert!(granted(f.acquire(1, now)).is_some());
    let leased_end = f.tat();
    assert_eq!(leased_end, now.as_nanos() + 65_000);
    // A request that costs nothing takes nothing from the lease, and keeps it.
    assert!(granted(f.acquire(0, now)).is_some());
    assert_eq!(f.tat(), leased_end);
    for _ in 0..63 {
        assert!(granted(f.acquire(1, now)).is_some());
        assert_eq!(f.tat(), leased_end, "leased units touch no shared state");
    }
    // The lease is used up: the next grant decides on the TAT and leases again.
    assert!(granted(f.acquire(1, now)).is_some());
    assert!(f.tat() > leased_end + 1_000);
    // Time moves past the lease's slots: they are expired, and given back.
    let later = Instant::from_nanos(f.tat() + 10_000);
    assert!(granted(f.acquire(1, later)).is_some());
    let (admitted, _, _) = f.counts();
    assert_eq!(admitted, 68, "the zero-cost request counted too");
}

/// A thread keeps the stripe it was first given; threads one after the other each own
/// one (an exiting thread gives its stripe back); threads alive together never own the
/// same stripe, and beyond the owned stripes they share the others.
#[test]
fn a_thread_keeps_its_stripe_and_owned_stripes_are_given_back() {
    let mut owned = 0;
    for _ in 0..3 * OWNED_STRIPES {
        let (first, again) = std::thread::spawn(|| {
            let first = stripe();
            assert_ne!(STRIPE.get(), usize::MAX, "the thread was given its place");
            (first, stripe())
        })
        .join()
        .unwrap();
        assert_eq!(first, again, "the same stripe on every call");
        owned += usize::from(first.1);
    }
    // Other tests of this binary may hold a few stripes meanwhile, never all of them for
    // long: without the give-back, no thread after the first sixteen of the process
    // would own one.
    assert!(owned > 2 * OWNED_STRIPES, "{owned} of {} threads in turn owned a stripe", 3 * OWNED_STRIPES);

    // Twice as many threads as owned stripes, all alive at once.
    let barrier = std::sync::Barrier::new(2 * OWNED_STRIPES);
    let places = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..2 * OWNED_STRIPES {
            s.spawn(|| {
                let place = stripe();
                places.lock().unwrap().push(place);
                barrier.wait();
            });
        }
    });
    let places = places.into_inner().unwrap();
    let mut mine: Vec<usize> = places.iter().filter(|p| p.1).map(|p| p.0).collect();
    let before = mine.len();
    mine.sort_unstable();
    mine.dedup();
    assert_eq!(mine.len(), before, "no owned stripe has two live owners: {places:?}");
    assert!(mine.iter().all(|&i| i < OWNED_STRIPES));
    assert!(places.iter().filter(|p| !p.1).all(|p| (OWNED_STRIPES..STRIPES).contains(&p.0)), "{places:?}");
    assert!(places.iter().any(|p| !p.1), "more threads than owned stripes: some share");
}

/// Threads that find no owned stripe free are spread over the shared ones, in turn.
#[test]
fn shared_stripes_are_taken_in_turn() {
    let picks: Vec<usize> = (0..10 * OWNED_STRIPES).map(shared_stripe).collect();
    assert!(picks.iter().all(|p| (OWNED_STRIPES..STRIPES).contains(p)), "{picks:?}");
    assert_eq!(&picks[..OWNED_STRIPES], (OWNED_STRIPES..STRIPES).collect::<Vec<_>>().as_slice());
    assert_eq!(picks[OWNED_STRIPES..2 * OWNED_STRIPES], picks[..OWNED_STRIPES]);
}

/// Counts made by many threads at once, more than the owned stripes, are all kept.
#[test]
fn counts_from_more_threads_than_stripes_are_exact() {
    let f = fast(Quota::per_second(nz!(1_000_000_000)).burst(nz!(1_000_000)));
    let now = Instant::from_nanos(1_000_000_000);
    std::thread::scope(|s| {
        for _ in 0..2 * OWNED_STRIPES {
            s.spawn(|| {
                for _ in 0..1_000 {
                    assert!(granted(f.acquire(1, now)).is_some());
                }
            });
        }
    });
    assert_eq!(f.counts().0, 2 * OWNED_STRIPES as u64 * 1_000);
}

/// Two limits leased by one thread keep a lease each: their ids pick different slots.
#[test]
fn a_thread_keeps_a_lease_per_limit() {
    // Ids come from a counter other tests draw from too: pick two in different slots.
    let limits: Vec<Fast> =
        (0..LEASE_SLOTS + 1).map(|_| fast(Quota::per_second(nz!(1_000_000)).burst(nz!(1_000)))).collect();
    let (one, two) = pair(&limits, |x, y| x.slot() != y.slot());
    let now = Instant::from_nanos(5_000_000);
    one.mark_contended();
    two.mark_contended();
    assert!(granted(one.acquire(1, now)).is_some());
    assert!(granted(two.acquire(1, now)).is_some());
    let (tat_one, tat_two) = (one.tat(), two.tat());
    assert!(granted(one.acquire(1, now)).is_some());
    assert!(granted(two.acquire(1, now)).is_some());
    assert_eq!((one.tat(), two.tat()), (tat_one, tat_two), "both granted from their leases");
}

/// What a thread records when its swap fails: the lease slot becomes this limit's,
/// marked contended; a lease of this limit keeps its units and its cooldown (and says
/// whether it may lease now); one of another limit, or of an earlier epoch, is dropped.
#[test]
fn a_failed_swap_marks_the_slot_as_this_limits() {
    let f = fast(Quota::per_second(nz!(1_000_000)).burst(nz!(1_000)));
    let other = fast(Quota::per_second(nz!(1_000_000)).burst(nz!(1_000)));
    // As after three replaces: a slot of an earlier epoch is not this one's.
    f.epoch.store(3, Ordering::Release);
    let epoch = f.epoch.load(Ordering::Acquire);
    let lease = |owner, epoch, cooldown| Lease {
        owner,
        epoch,
        taken: 7,
        floor: 9,
        // Every field its own value: the slot keeps each in a cell of its own.
        start: 10,
        next: 12,
        end: 20,
        lead: 5,
        size: 256,
        contended: false,
        cooldown,
    };
    let fresh = Lease { owner: f.id, epoch, contended: true, ..NO_LEASE };
    let same = |a: Lease, b: Lease| {
        (a.owner, a.epoch, a.taken, a.floor, a.start, a.next, a.end, a.lead, a.size, a.contended, a.cooldown)
            == (b.owner, b.epoch, b.taken, b.floor, b.start, b.next, b.end, b.lead, b.size, b.contended, b.cooldown)
    };
    for (before, may, after) in [
        (NO_LEASE, true, fresh),
        (lease(other.id, epoch, 3), true, fresh),
        (lease(f.id, epoch + 1, 3), true, fresh),
        (lease(f.id, epoch, 0), true, Lease { contended: true, ..lease(f.id, epoch, 0) }),
        (lease(f.id, epoch, 3), false, Lease { contended: true, ..lease(f.id, epoch, 3) }),
    ] {
        let cell = LeaseCell::new();
        cell.set(before);
        assert_eq!(f.mark_seen(&cell), may);
        assert!(
            same(cell.get(), after),
            "from owner {} epoch {} cooldown {}",
            before.owner,
            before.epoch,
            before.cooldown
        );
    }
}

/// A lease of another limit that shares the slot is not this limit's to use, nor to end,
/// even when their epochs agree.
#[test]
fn a_lease_in_the_slot_of_another_limit_is_not_used() {
    // Ids come from a counter other tests draw from too: pick two that share a slot.
    let limits: Vec<Fast> =
        (0..LEASE_SLOTS + 1).map(|_| fast(Quota::per_second(nz!(1_000_000)).burst(nz!(1_000)))).collect();
    let (a, b) = pair(&limits, |x, y| x.slot() == y.slot());
    assert_eq!(a.epoch.load(Ordering::Acquire), b.epoch.load(Ordering::Acquire));
    let now = Instant::from_nanos(5_000_000);
    a.mark_contended();
    assert!(granted(a.acquire(1, now)).is_some());
    // `b` has seen contention too, but the slot holds `a`'s lease.
    b.contended.store(true, Ordering::Relaxed);
    let before = b.tat();
    assert!(granted(b.acquire(1, now)).is_some());
    assert_ne!(b.tat(), before, "b decided on its own state");
    // ... and left the lease whole: `a` still grants from it.
    let leased = a.tat();
    assert!(granted(a.acquire(1, now)).is_some());
    assert_eq!(a.tat(), leased, "a granted from its lease");
}

/// A lease whose slots began unused is given back (the TAT returns to its first unused
/// unit), and teaches the thread its pace: its next lease begins that far past the clock.
/// A lease that led the clock and still expired sends the thread to decide on the shared
/// TAT for `COOLDOWN` calls before it leases again.
#[test]
fn an_expired_lease_is_given_back_and_the_next_one_leads_the_clock() {
    // T = 1us, burst 100,000.
    let f = fast(Quota::per_second(nz!(1_000_000)).burst(nz!(100_000)));
    let t0 = 5_000_000;
    f.mark_contended();
    assert!(granted(f.acquire(1, Instant::from_nanos(t0))).is_some());
    let end = f.tat();
    assert_eq!(end, t0 + 64_000, "a lease of 63 units beside the grant");
    for _ in 0..2 {
        assert!(granted(f.acquire(1, Instant::from_nanos(t0))).is_some());
    }
    assert_eq!(f.tat(), end);
    // 10us on, the lease's next unit (t0 + 3us) has begun: it is given back first, so
    // this grant lands right after the clock. Two units' slots went by in 10us: at that
    // pace a lease of 64 would fall 4 x 64us behind its slots, so the next lease begins
    // twice that, 512us, past the clock.
    let t1 = t0 + 10_000;
    assert!(granted(f.acquire(1, Instant::from_nanos(t1))).is_some());
    let lead = 2 * 64 * 1_000 * (10_000 - 2_000) / 2_000;
    assert_eq!(lead, 512_000);
    assert_eq!(f.tat(), t1 + lead + 63_000, "given back, then a lease that leads the clock");
    // At the same pace, every unit of it is used before its slot begins.
    let mut t = t1;
    for i in 0..63 {
        t += 5_000;
        assert!(granted(f.acquire(1, Instant::from_nanos(t))).is_some());
        assert_eq!(f.tat(), t1 + lead + 63_000, "unit {i} from the lease");
    }
    // A thread far slower than its lead: the leading lease expires too, and the thread
    // cools down, one unit per call on the shared TAT...
    assert!(granted(f.acquire(1, Instant::from_nanos(t))).is_some());
    let (start, end) = (f.tat() - 63_000, f.tat());
    assert!(start > t + 64_000, "the next lease leads the clock");
    let t3 = end + 1_000_000;
    assert!(granted(f.acquire(1, Instant::from_nanos(t3))).is_some());
    assert_eq!(f.tat(), t3 + 1_000, "given back, then one unit from the clock");
    for i in 1..COOLDOWN {
        assert!(granted(f.acquire(1, Instant::from_nanos(t3))).is_some());
        assert_eq!(f.tat(), t3 + 1_000 * (1 + u64::from(i)), "call {i} of the cooldown");
    }
    // ...and then a lease again.
    let before = f.tat();
    assert!(granted(f.acquire(1, Instant::from_nanos(t3))).is_some());
    assert!(f.tat() >= before + 64_000, "a lease once the cooldown is over");
}

/// A lead is at most a quarter of the headroom left after the grant, and the lease after
/// it a quarter of what remains: the whole stays within the tolerance, as plain GCRA's
/// rule asks of every unit admitted at the instant the lease is taken.
#[test]
fn a_lead_is_cut_to_a_quarter_of_the_headroom() {
    // T = 1us, burst 100: the tolerance is 100us.
    let f = fast(Quota::per_second(nz!(1_000_000)).burst(nz!(100)));
    let t0 = 5_000_000;
    f.mark_contended();
    assert!(granted(f.acquire(1, Instant::from_nanos(t0))).is_some());
    assert_eq!(f.tat(), t0 + 1_000 + 24_000, "a quarter of the 99 units left");
    // 10us on, the lease went stale unused: it is given back and teaches a lead of
    // 1,152us (2 x 64 x 9us), cut to the tolerance and then to a quarter of the 99us of
    // headroom left after this grant: 24.75us, then 18 units, a quarter of what remains.
    let t1 = t0 + 10_000;
    assert!(granted(f.acquire(1, Instant::from_nanos(t1))).is_some());
    assert_eq!(f.tat(), t1 + 1_000 + 24_750 + 18_000);
    assert!(f.tat() <= t1 + 100_000, "within the tolerance");
}

/// T = 1us, burst 100,000, and this thread under contention: its first lease, taken at
/// 5 ms, goes stale unused and, given back 10us on, teaches a lead, so the lease taken
/// then begins past the clock. The limit, and the instant of that second lease.
fn leading_lease() -> (Fast, u64) {
    let f = fast(Quota::per_second(nz!(1_000_000)).burst(nz!(100_000)));
    let t0 = 5_000_000;
    f.mark_contended();
    assert!(granted(f.acquire(1, Instant::from_nanos(t0))).is_some());
    let t1 = t0 + 10_000;
    assert!(granted(f.acquire(1, Instant::from_nanos(t1))).is_some());
    (f, t1)
}

/// A grant that leases nothing (a quarter of the headroom it leaves is less than one more
/// grant of its cost) begins no lead either: the TAT moves by the grant alone, exactly as
/// plain GCRA's.
#[test]
fn a_grant_without_a_lease_keeps_no_lead() {
    let (f, t1) = leading_lease();
    let leased = f.tat();
    assert!(leased > t1 + 64_000, "the next lease leads the clock");
    // That lease is still unused when a request of 30,000 units comes, 50us on: its units
    // cannot serve it, so they go back with the lead before them (none was used), and the
    // grant, which leaves 70,000 units of headroom (a quarter of it is less than another
    // 30,000), takes no lead either, though the thread's pace now asks for one: it lands
    // right after the clock.
    let t2 = t1 + 50_000;
    assert!(granted(f.acquire(30_000, Instant::from_nanos(t2))).is_some());
    assert_eq!(f.tat(), t2 + 30_000_000, "no lead without a lease");
}

/// Drives `f` (T = 1us and a burst of a second: a quarter of the headroom is far above any
/// lease) with calls of `cost` at one instant, contended: each lease, of 64 grants of
/// `cost` first, is used to its last unit and the next one doubles, up to `MAX_LEASE`.
/// Returns that instant.
fn assert_leases_double(f: &Fast, cost: u64) -> Instant {
    f.mark_contended();
    let t0 = Instant::from_nanos(5_000_000_000);
    for expected in [64, 128, 256, 512, 1_024, 1_024] {
        // At one instant nothing is ever late: the new lease is taken with this grant,
        // and its units serve the next calls without moving the shared TAT.
        let before = f.tat().max(t0.as_nanos());
        assert!(granted(f.acquire(cost, t0)).is_some());
        assert_eq!(f.tat() - before, expected * cost * 1_000, "a lease of {expected} grants of {cost} with its grant");
        let leased = f.tat();
        for _ in 1..expected {
            assert!(granted(f.acquire(cost, t0)).is_some());
        }
        assert_eq!(f.tat(), leased, "all from the lease");
    }
    assert_eq!(LEASES.with(|l| l[f.slot()].get().size), MAX_LEASE);
    t0
}

/// A lease is a whole number of grants of the cost of the call that takes it, so a thread
/// whose calls all cost the same uses it to its last unit and its next lease doubles, in
/// grants: one shared write per lease however much each grant costs, as for a cost of one.
/// (Counted in units and cut at 64, a lease taken by calls of 10 served six of them and
/// went back with four units: one shared write every six grants, for good.)
#[test]
fn a_lease_holds_whole_grants_of_its_cost_and_grows_by_grants() {
    let f = fast(Quota::per_second(nz!(1_000_000)));
    assert_leases_double(&f, 10);
    // A cost that does not divide the quarter of the headroom: the lease is cut down to
    // whole grants. T = 1us, burst 1,000: after a grant of 7 at an idle limit, 993 units
    // are left, a quarter is 248, and 35 grants of 7 (245 units) are leased.
    let g = fast(Quota::per_second(nz!(1_000_000)).burst(nz!(1_000)));
    g.mark_contended();
    let now = Instant::from_nanos(5_000_000);
    assert!(granted(g.acquire(7, now)).is_some());
    assert_eq!(g.tat(), now.as_nanos() + (7 + 245) * 1_000);
    // Near the limit a quarter of the headroom is less than one more grant: none.
    let h = fast(Quota::per_second(nz!(1_000_000)).burst(nz!(100)));
    h.mark_contended();
    assert!(granted(h.acquire(30, now)).is_some());
    assert_eq!(h.tat(), now.as_nanos() + 30_000, "70 left, a quarter is 17: no grant of 30 leased");
}

/// A lease used to its last unit that led the clock is no sign that leasing does not pay,
/// however long the thread then waits: its next call leases again.
#[test]
fn a_lease_used_up_leaves_no_cooldown() {
    let (f, t1) = leading_lease();
    let end = f.tat();
    // Every unit of the leading lease, at the pace that taught its lead.
    let mut t = t1;
    for _ in 0..63 {
        t += 5_000;
        assert!(granted(f.acquire(1, Instant::from_nanos(t))).is_some());
    }
    assert_eq!(f.tat(), end, "all from the lease");
    // Long after the lease's end, the next call takes a lease again.
    let later = end + 10_000_000;
    assert!(granted(f.acquire(1, Instant::from_nanos(later))).is_some());
    assert!(f.tat() >= later + 64_000, "a lease, not a cooldown");
}

/// A lease used to its last unit, each before its slot began, doubles the thread's next
/// one, up to `MAX_LEASE`; a lease whose slot began unused halves it, not below
/// `FIRST_LEASE`; a lease with too few units left for a cost keeps it.
#[test]
fn a_threads_lease_grows_while_it_is_used_up_and_shrinks_when_slots_go_unused() {
    let f = fast(Quota::per_second(nz!(1_000_000)));
    let size = || LEASES.with(|l| l[f.slot()].get().size);
    let t0 = assert_leases_double(&f, 1);
    // One more grant takes a lease of 1,024; a call far later finds its slots begun
    // unused: the size halves.
    assert!(granted(f.acquire(1, t0)).is_some());
    assert_eq!(size(), MAX_LEASE);
    let t = t0.as_nanos() + 10_000_000_000;
    assert!(granted(f.acquire(1, Instant::from_nanos(t))).is_some());
    assert_eq!(size(), MAX_LEASE / 2, "after a stale lease");
    // A first lease gone stale leaves the first size: no lower.
    let g = fast(Quota::per_second(nz!(1_000_000)));
    g.mark_contended();
    assert!(granted(g.acquire(1, t0)).is_some());
    assert!(granted(g.acquire(1, Instant::from_nanos(t))).is_some());
    assert_eq!(LEASES.with(|l| l[g.slot()].get().size), FIRST_LEASE);
    // Too few units left in a lease for a cost: the size stays, also when the lease's next
    // slot begins at that very instant (it has not begun unused).
    let h = fast(Quota::per_second(nz!(1_000_000)));
    h.mark_contended();
    let h_size = || LEASES.with(|l| l[h.slot()].get().size);
    // A lease of 63 grants of 1; a call of 64 finds too few units in it.
    assert!(granted(h.acquire(1, t0)).is_some());
    assert!(granted(h.acquire(FIRST_LEASE, t0)).is_some());
    assert_eq!(h_size(), FIRST_LEASE);
    // That call took a lease of 63 grants of 64: those, and a call that finds it used up.
    for _ in 0..FIRST_LEASE {
        assert!(granted(h.acquire(FIRST_LEASE, t0)).is_some());
    }
    assert_eq!(h_size(), 2 * FIRST_LEASE, "a lease used up");
    let next = LEASES.with(|l| l[h.slot()].get().next);
    let end = LEASES.with(|l| l[h.slot()].get().end);
    let above = (end - next) / 1_000 + 1;
    assert!(granted(h.acquire(above, Instant::from_nanos(next))).is_some());
    assert_eq!(h_size(), 2 * FIRST_LEASE, "too few units at the instant of the next slot");
}

/// The path raises `now` to the latest instant it granted at, for grants and for the
/// reads of the locked side, so a clock read that lags decides as if on time.
#[test]
fn an_earlier_now_is_raised_to_the_latest_grant() {
    let f = fast(Quota::per_second(nz!(1)).burst(nz!(5)));
    let at = |s: u64| Instant::from_nanos(s * 1_000_000_000);
    assert_eq!(granted(f.acquire(1, at(10))), Some(at(10).as_nanos()));
    assert_eq!(granted(f.acquire(1, at(3))), Some(at(10).as_nanos()), "raised to the latest grant");
    assert_eq!(f.latest(), at(10));
}

#[test]
fn near_the_limit_a_lease_shrinks_to_nothing() {
    let f = fast(Quota::per_second(nz!(1_000_000)).burst(nz!(8)));
    f.mark_contended();
    let now = Instant::from_nanos(1_000_000);
    for _ in 0..8 {
        assert!(granted(f.acquire(1, now)).is_some());
    }
    // Exactly the burst, as plain GCRA: no unit more, none stranded.
    assert_eq!(granted(f.acquire(1, now)), None);
    assert_eq!(f.tat(), now.as_nanos() + 8_000);
}

#[test]
fn leasing_threads_never_over_admit() {
    // T = 1us, burst 1,000. The shared clock alternates between a slow phase (demand
    // seven tenths of the rate: the headroom refills and leases are up to a quarter of it)
    // and a fast one (fourteen times the rate: the limit is reached and leases shrink to
    // nothing). Each thread asks a cost of its own, 1, 2, 3 or 5 units, so its leases are
    // whole grants of that cost; every unit is checked against the cap.
    const THREADS: u64 = 4;
    const STEPS: u64 = 20_000;
    let f = fast(Quota::per_second(nz!(1_000_000)).burst(nz!(1_000)));
    let clock = AtomicU64::new(0);
    let grants = Mutex::new(Vec::new());
    let seen_refused = AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (f, clock, grants, seen_refused) = (&f, &clock, &grants, &seen_refused);
            let cost = [1, 2, 3, 5][t as usize];
            s.spawn(move || {
                f.mark_contended();
                let mut mine = Vec::new();
                for i in 0..STEPS {
                    let step = if (i / 2_000) % 2 == 0 { 2_000 } else { 100 };
                    let now = Instant::from_nanos(clock.fetch_add(step, Ordering::Relaxed));
                    match granted(f.acquire(cost, now)) {
                        Some(at) => mine.extend((0..cost).map(|_| at)),
                        None => {
                            seen_refused.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                grants.lock().unwrap().extend(mine);
            });
        }
    });
    let units = grants.into_inner().unwrap();
    let (admitted, refused, _) = f.counts();
    assert_eq!(admitted + refused, THREADS * STEPS);
    assert_eq!(refused, seen_refused.into_inner());
    assert!(refused > 0, "the fast phases reach the limit");
    assert_rate_cap(units, 1_000, 1_000_000);
}

/// A call whose clock read lagged behind other threads' grants by more than the tolerance
/// finds the TAT past its instant by more than any grant leaves it: it is decided again
/// at the latest instant of any grant, as under the global lock, and counted once, as
/// what it finally is. (Decided at its own instant it was refused with the limit far
/// from exhausted.)
#[test]
fn a_clock_read_that_lagged_is_decided_at_the_latest_grant() {
    // T = 1us, burst 1,000: a tolerance of 1 ms.
    let f = fast(Quota::per_second(nz!(1_000_000)).burst(nz!(1_000)));
    let ms = |n: u64| Instant::from_nanos(n * 1_000_000);
    // This thread's grants at 10 ms: 500 units of the 1,000.
    assert_eq!(granted(f.acquire(500, ms(10))), Some(ms(10).as_nanos()));
    // Another thread, whose clock read says 1 ms: granted at 10 ms.
    std::thread::scope(|s| {
        s.spawn(|| assert_eq!(granted(f.acquire(1, ms(1))), Some(ms(10).as_nanos()), "decided at the latest grant"));
    });
    assert_eq!(f.counts(), (2, 0, 0), "two grants, no refusal counted");
    // At the latest instant the limit refuses too: refused there, counted once, with the
    // wait from that instant.
    std::thread::scope(|s| {
        s.spawn(|| match f.acquire(600, ms(1)) {
            Some(Decision::Refused(tat, at)) => {
                assert_eq!(at, ms(10), "decided at the latest grant");
                assert_eq!(f.refusal(tat, at, 600).retry_after(), Duration::from_micros(101));
            }
            _ => panic!("600 units do not fit at 10 ms"),
        });
    });
    assert_eq!(f.counts(), (2, 1, 0));

    // A lag that leaves the TAT no further than the tolerance past the call's instant is
    // answered there, though the latest instant would grant: a grant at 10 ms of 500
    // units (the TAT at 10.5 ms), a call of 1 at 9.5 ms (the TAT exactly the tolerance
    // past it), and one of 300 at 9.7 ms (granted at 10 ms, refused at 9.7).
    for (cost, at) in [(1, 9_500_000), (300, 9_700_000)] {
        // A limit of its own: stripes that no other thread wrote.
        let g = fast(Quota::per_second(nz!(1_000_000)).burst(nz!(1_000)));
        assert!(granted(g.acquire(500, ms(10))).is_some());
        std::thread::scope(|s| {
            s.spawn(|| match g.acquire(cost, Instant::from_nanos(at)) {
                Some(Decision::Refused(_, when)) => assert_eq!(when.as_nanos(), at, "answered at its own instant"),
                _ => panic!("{cost} at {at} is refused"),
            });
        });
        assert_eq!(g.counts(), (1, 1, 0));
    }
}
