//! The leases of the lock-free path: what a thread keeps of the TAT it took ahead of
//! time, and how it takes, uses and gives back leases (see the parent module's essay,
//! *Leases: no collapse on many cores*).

use std::cell::Cell;
use std::sync::atomic::Ordering;

use super::stripes::Stripe;
use super::{Fast, Packed};

/// How many limits a thread keeps a lease for at once (a power of two); a limit's lease
/// lives in the slot its id picks, and a lease evicted from it is stranded (see the
/// module's essay).
pub(super) const LEASE_SLOTS: usize = 4;

/// The most grants a thread's first lease of a limit holds (units: grants of the cost of
/// the call that takes it), and the least its lease size shrinks to.
pub(super) const FIRST_LEASE: u64 = 64;

/// The most grants one lease holds, however fast its thread uses them.
pub(super) const MAX_LEASE: u64 = 1_024;

/// Unused slots of the TAT that one thread took ahead of time: units `next`, `next + T`,
/// ... up to `end`. A unit is used only while its slot has not begun.
#[derive(Clone, Copy)]
pub(super) struct Lease {
    /// The [`Fast::id`] it belongs to; 0 for none.
    pub(super) owner: u64,
    /// The [`Fast::epoch`] it was taken in: a replace voids it.
    pub(super) epoch: u64,
    /// The instant it was taken at: a unit is never used at an earlier one.
    pub(super) taken: u64,
    /// Where its claim on the TAT began: its first unit, or the start of the lead before
    /// it.
    pub(super) floor: u64,
    /// Its first unit; `start == end` once it has ended and taught its pace.
    pub(super) start: u64,
    pub(super) next: u64,
    pub(super) end: u64,
    /// How far past the clock this thread's next lease begins, learned from the pace at
    /// which it used its last one (0 while it uses units faster than their slots begin).
    pub(super) lead: u64,
    /// The most grants this thread's next lease takes, each of the cost of the call that
    /// takes it: doubled after a lease used up before its slots began, halved after one
    /// whose slots began unused, within [`FIRST_LEASE`] ..= [`MAX_LEASE`].
    pub(super) size: u64,
    /// Whether this thread has seen a compare-and-swap on this limit fail.
    pub(super) contended: bool,
    /// Calls to wait before leasing again, after a lease whose slots began unused (the
    /// interval is shorter than this thread's pace: leasing would only waste).
    pub(super) cooldown: u32,
}

/// The calls a thread waits before leasing again after a lease expired unused.
pub(super) const COOLDOWN: u32 = 4_096;

pub(super) const NO_LEASE: Lease = Lease {
    owner: 0,
    epoch: 0,
    taken: 0,
    floor: 0,
    start: 0,
    next: 0,
    end: 0,
    lead: 0,
    size: FIRST_LEASE,
    contended: false,
    cooldown: 0,
};

/// A thread's lease of one limit, kept field by field: a grant from the lease reads a few
/// words and writes one, where a whole [`Lease`] copied out of a `Cell` and back on every
/// grant cost, with two threads leasing, more than the lease saved (see the module's
/// essay).
pub(super) struct LeaseCell {
    pub(super) owner: Cell<u64>,
    pub(super) epoch: Cell<u64>,
    pub(super) taken: Cell<u64>,
    pub(super) floor: Cell<u64>,
    pub(super) start: Cell<u64>,
    pub(super) next: Cell<u64>,
    pub(super) end: Cell<u64>,
    pub(super) lead: Cell<u64>,
    pub(super) size: Cell<u64>,
    pub(super) contended: Cell<bool>,
    pub(super) cooldown: Cell<u32>,
}

impl LeaseCell {
    pub(super) const fn new() -> Self {
        let l = NO_LEASE;
        LeaseCell {
            owner: Cell::new(l.owner),
            epoch: Cell::new(l.epoch),
            taken: Cell::new(l.taken),
            floor: Cell::new(l.floor),
            start: Cell::new(l.start),
            next: Cell::new(l.next),
            end: Cell::new(l.end),
            lead: Cell::new(l.lead),
            size: Cell::new(l.size),
            contended: Cell::new(l.contended),
            cooldown: Cell::new(l.cooldown),
        }
    }

    pub(super) fn get(&self) -> Lease {
        Lease {
            owner: self.owner.get(),
            epoch: self.epoch.get(),
            taken: self.taken.get(),
            floor: self.floor.get(),
            start: self.start.get(),
            next: self.next.get(),
            end: self.end.get(),
            lead: self.lead.get(),
            size: self.size.get(),
            contended: self.contended.get(),
            cooldown: self.cooldown.get(),
        }
    }

    pub(super) fn set(&self, l: Lease) {
        self.owner.set(l.owner);
        self.epoch.set(l.epoch);
        self.taken.set(l.taken);
        self.floor.set(l.floor);
        self.start.set(l.start);
        self.next.set(l.next);
        self.end.set(l.end);
        self.lead.set(l.lead);
        self.size.set(l.size);
        self.contended.set(l.contended);
        self.cooldown.set(l.cooldown);
    }
}

#[cfg(not(loom))]
thread_local! {
    /// This thread's leases, looked at only once a limit has seen contention.
    pub(super) static LEASES: [LeaseCell; LEASE_SLOTS] = const { [const { LeaseCell::new() }; LEASE_SLOTS] };
}

// Under loom, each modelled thread starts every execution with fresh ones.
#[cfg(loom)]
loom::thread_local! {
    pub(super) static LEASES: [LeaseCell; LEASE_SLOTS] = [const { LeaseCell::new() }; LEASE_SLOTS];
}

impl Fast {
    /// Whether the lease in `entry` is this limit's, taken since its last replace.
    #[inline(always)]
    pub(super) fn owns(&self, entry: &LeaseCell) -> bool {
        entry.owner.get() == self.id && entry.epoch.get() == self.epoch.load(Ordering::Acquire)
    }

    /// This limit's slot among a thread's leases.
    #[inline]
    pub(super) fn slot(&self) -> usize {
        (self.id as usize) & (LEASE_SLOTS - 1)
    }

    /// Records in `entry` that this thread saw a swap on this limit fail; returns whether
    /// it may lease (not cooling down).
    pub(super) fn mark_seen(&self, entry: &LeaseCell) -> bool {
        let epoch = self.epoch.load(Ordering::Acquire);
        let mut l = entry.get();
        if l.owner != self.id || l.epoch != epoch {
            l = Lease { owner: self.id, epoch, ..NO_LEASE };
        }
        l.contended = true;
        entry.set(l);
        l.cooldown == 0
    }

    /// The decision once the limit has seen contention and this thread's lease of it, if
    /// it has one, cannot serve the call ([`Fast::decide_packed`] grants from a lease that
    /// can): ends that lease, learning this thread's pace from it, and decides on the
    /// shared TAT (leasing, if this thread has seen a swap fail).
    #[inline(never)]
    pub(super) fn decide_leased(&self, cost: u64, now: u64, latest: u64, (stripe, own): (&Stripe, bool)) -> Packed {
        LEASES.with(|leases| {
            let entry = &leases[self.slot()];
            let mine = self.owns(entry);
            if mine {
                let now = now.max(entry.taken.get());
                let mut lease = entry.get();
                if lease.start < lease.end {
                    // The lease has ended. Its units went at this thread's pace: the next
                    // lease begins far enough past the clock for all of its units to be
                    // used before their slots begin.
                    let led = lease.lead > 0;
                    let used = lease.next - lease.start;
                    // Used up, every unit before its slot began: the next lease may be
                    // larger. A slot began unused: smaller. (Too few units left for this
                    // cost: as large.)
                    if lease.next == lease.end {
                        lease.size = (lease.size * 2).min(MAX_LEASE);
                    } else if lease.next < now {
                        lease.size = (lease.size / 2).max(FIRST_LEASE);
                    }
                    lease.lead = self.lead_for(now - lease.taken, used, lease.size.saturating_mul(cost));
                    if lease.next < lease.end {
                        // Give back what is left, if nobody moved the TAT past this lease
                        // (read first: a failing swap would still take the line); with the
                        // lead before it, if no unit of it was used.
                        let back = if used == 0 { lease.floor } else { lease.next };
                        if self.tat.0.load(Ordering::Acquire) == lease.end {
                            let _ = self.tat.0.compare_exchange(lease.end, back, Ordering::AcqRel, Ordering::Acquire);
                        }
                        // Slots began unused although the lease led the clock: leasing
                        // does not pay for this thread now.
                        if lease.next < now && led {
                            lease.cooldown = COOLDOWN;
                        }
                    }
                    lease.start = lease.end;
                    lease.next = lease.end;
                } else if lease.cooldown > 0 {
                    lease.cooldown -= 1;
                }
                entry.set(lease);
            }
            let lease_ok = mine && entry.contended.get() && entry.cooldown.get() == 0;
            self.decide(cost, now, latest, (stripe, own), entry, lease_ok)
        })
    }

    /// The decision on the shared TAT; under contention, takes a lease for later calls.
    #[inline]
    pub(super) fn decide(
        &self,
        cost: u64,
        now: u64,
        latest: u64,
        (stripe, own): (&Stripe, bool),
        entry: &LeaseCell,
        mut lease_ok: bool,
    ) -> Packed {
        let epoch = self.epoch.load(Ordering::Acquire);
        let interval = self.gcra.interval_nanos();
        let mut cur = self.tat.0.load(Ordering::Acquire);
        loop {
            let granted = match self.decide_on(cur, cost, now, (stripe, own)) {
                Ok(granted) => granted,
                Err(answer) => return answer,
            };
            // Under contention, lease a quarter of the headroom left (at most the thread's
            // lease size in all, in grants of this call's cost), beginning `lead` past the
            // clock (at most a quarter of the headroom on); near the limit that is
            // nothing, and the decision is exact. The lease is a whole number of grants of
            // this cost, so that a thread whose calls all cost the same uses it to its
            // last unit (and its next one grows): a lease of 64 units taken by calls of 10
            // served six of them, then went back with 4 units unused, and its thread
            // never leased more, so two threads made one shared write every six grants.
            let learned = entry.get();
            let (first, extra) = if lease_ok {
                let room = now + self.tolerance - granted;
                let gap = (now + learned.lead).saturating_sub(granted).min(room / 4);
                let most = learned.size.saturating_sub(1).saturating_mul(cost);
                let extra = ((room - gap) / interval / 4).min(most);
                let extra = extra - extra.checked_rem(cost).unwrap_or(0);
                (if extra > 0 { granted + gap } else { granted }, extra)
            } else {
                (granted, 0)
            };
            let new = first + extra * interval;
            match self.tat.0.compare_exchange(cur, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    if extra > 0 {
                        entry.set(Lease {
                            owner: self.id,
                            epoch,
                            taken: now,
                            floor: granted,
                            start: first,
                            next: first,
                            end: new,
                            lead: learned.lead,
                            size: learned.size,
                            contended: true,
                            cooldown: 0,
                        });
                    }
                    return self.granted(stripe, own, latest, now);
                }
                Err(seen) => {
                    cur = seen;
                    lease_ok = self.mark_seen(entry);
                }
            }
        }
    }

    /// How far past the clock a lease must begin for a thread that used `used`
    /// nanoseconds of slots in `elapsed` nanoseconds (counted as one unit's when it used
    /// none: its pace is at least that slow): twice the slack a whole lease of `units`
    /// would build up at that pace (none when the slots go by slower than the thread uses
    /// them), at most the tolerance.
    pub(super) fn lead_for(&self, elapsed: u64, used: u64, units: u64) -> u64 {
        let used = used.max(self.gcra.interval_nanos());
        if elapsed <= used {
            return 0;
        }
        // The products saturate, and the lead is cut to the tolerance anyway.
        let lease = u128::from(units).saturating_mul(u128::from(self.gcra.interval_nanos()));
        let lead = lease.saturating_mul(2).saturating_mul(u128::from(elapsed - used)) / u128::from(used);
        u64::try_from(lead).unwrap_or(u64::MAX).min(self.tolerance)
    }
}
