//! The lock-free path of a set of one global GCRA limit: the commonest use, one rate
//! limit on one service, decided by one compare-and-swap.
//!
//! # The state and who may touch it
//!
//! The limit's theoretical arrival time (TAT) lives in one `AtomicU64` word, tagged with
//! the *generation* of the parameters it was computed under: `generation << 58 | tat`. An
//! acquisition reads the parameters (interval, tolerance, burst, the limit's name and
//! the policy version) from a sequence lock, then loops: load the word, decide exactly as
//! [`Gcra::acquire`](crate::algorithm::Gcra) does, and compare-and-swap the new TAT in.
//! A denial writes nothing to the state. Nothing is locked and nothing is allocated.
//!
//! Everything else (settling, refunds, peeks, stats, policy changes) keeps going through
//! the set's global mutex, unchanged: whoever takes that lock *borrows* the word, swapping
//! in [`CLOSED`] and moving the TAT into the mutex-protected state, and gives it back when
//! it unlocks. While the word is closed, acquisitions take the mutex path too. So the
//! lock-free path and the locked one never both own the state, and every law proved for
//! the locked engine holds for the lock-free one: it is the same decision on the same
//! state, made atomically by a CAS instead of under a lock.
//!
//! # Policy changes
//!
//! [`LimitSet::replace_policy`](crate::LimitSet::replace_policy) runs with the word
//! borrowed. When the new policy is again one global GCRA, it writes the new parameters
//! under the sequence lock with the next generation, and the word comes back tagged with
//! it. An acquisition that read the old parameters and then finds a word of another
//! generation (or the closed word) starts over: it can never apply old parameters to a
//! state of the new policy. (The tag has 6 bits: a stale acquisition would have to sleep
//! through exactly 64 policy changes between two loads for its CAS to be fooled.)
//!
//! # Limits of the scheme
//!
//! The TAT must fit in 58 bits (nine years of the process clock) and the tolerance in
//! 56 (two years): a policy or a clock beyond them uses the mutex path, which decides the
//! same. One word that every admission writes is one cache line that every core
//! contends for; this is governor's design too, and per-core leases that spare it when
//! the limit is far from exhausted are the next step (see the guide's performance page).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use crate::algorithm::{Gcra, GcraState, Snapshot};
use crate::error::{AcquireError, CostAboveCapacity, Denial};
use crate::time::Instant;

/// The word while the mutex path owns the state (or the set is not one global GCRA).
pub(crate) const CLOSED: u64 = u64::MAX;

const TAT_BITS: u32 = 58;
const TAT_MASK: u64 = (1 << TAT_BITS) - 1;
const GEN_MASK: u64 = (1 << (64 - TAT_BITS)) - 1;
/// The longest tolerance the lock-free path takes on: keeps `now + tolerance` in range.
const MAX_TOLERANCE: u64 = 1 << 56;

/// Counters split over cache lines by thread, so that counting does not put back the
/// shared write the CAS path saves everywhere else.
const STRIPES: usize = 8;

#[repr(align(128))]
#[derive(Default)]
struct Line<T>(T);

#[derive(Default)]
struct Stripe {
    /// The latest instant a grant was made at, for the set's monotonic clock.
    latest: AtomicU64,
    admitted: AtomicU64,
    denied: AtomicU64,
    impossible: AtomicU64,
}

/// The lock-free state of a set of one global GCRA limit.
pub(crate) struct FastGcra {
    word: Line<AtomicU64>,
    params: Line<Params>,
    /// The limit's name: a policy change that renames the set's one limit turns the
    /// lock-free path off for good (the mutex path decides the same).
    name: &'static str,
    stripes: [Line<Stripe>; STRIPES],
}

#[derive(Default)]
struct Params {
    seq: AtomicU64,
    off: AtomicBool,
    generation: AtomicU64,
    version: AtomicU64,
    counts_cost: AtomicBool,
    interval: AtomicU64,
    tolerance: AtomicU64,
    burst: AtomicU64,
}

/// The parameters one acquisition decides with.
#[derive(Clone, Copy)]
struct Snap {
    generation: u64,
    version: u64,
    counts_cost: bool,
    name: &'static str,
    interval: u64,
    tolerance: u64,
    burst: u64,
}

/// The outcome of the lock-free path.
pub(crate) enum Fast {
    Granted {
        at: Instant,
        version: u64,
    },
    Refused(AcquireError),
    /// The mutex path must decide.
    Locked,
}

/// Counts taken from the lock-free path: `(admitted, denied, impossible)`.
pub(crate) type Drained = (u64, u64, u64);

fn stripe() -> usize {
    use std::cell::Cell;
    thread_local! {
        static STRIPE: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    STRIPE.with(|s| {
        let mut i = s.get();
        if i == usize::MAX {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            i = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
            s.set(i);
        }
        i
    })
}

impl FastGcra {
    /// A lock-free path for the limit named `name`, closed until configured.
    pub(crate) fn new(name: &'static str) -> Self {
        FastGcra { word: Line(AtomicU64::new(CLOSED)), params: Line::default(), name, stripes: Default::default() }
    }

    /// Whether the lock-free path may still open.
    pub(crate) fn is_on(&self) -> bool {
        !self.params.0.off.load(Ordering::Relaxed)
    }

    /// Turns the lock-free path off for good (the word must be borrowed).
    pub(crate) fn turn_off(&self) {
        self.params.0.off.store(true, Ordering::Relaxed);
    }

    /// Whether a limit can take the lock-free path.
    pub(crate) fn fits(gcra: &Gcra) -> bool {
        gcra.tolerance_nanos() <= MAX_TOLERANCE
    }

    /// Sets the parameters for `gcra` under a new generation; the word must be borrowed.
    /// A limit of another name, or one beyond the path's ranges, turns it off.
    pub(crate) fn configure(&self, gcra: &Gcra, name: &'static str, counts_cost: bool, version: u64) {
        if name != self.name || !Self::fits(gcra) {
            self.turn_off();
            return;
        }
        let p = &self.params.0;
        let seq = p.seq.load(Ordering::Relaxed);
        p.seq.store(seq + 1, Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Release);
        p.generation.store((p.generation.load(Ordering::Relaxed) + 1) & GEN_MASK, Ordering::Relaxed);
        p.version.store(version, Ordering::Relaxed);
        p.counts_cost.store(counts_cost, Ordering::Relaxed);
        p.interval.store(gcra.interval_nanos(), Ordering::Relaxed);
        p.tolerance.store(gcra.tolerance_nanos(), Ordering::Relaxed);
        p.burst.store(gcra.burst(), Ordering::Relaxed);
        p.seq.store(seq + 2, Ordering::Release);
    }

    fn snap(&self) -> Option<Snap> {
        let p = &self.params.0;
        let before = p.seq.load(Ordering::Acquire);
        if before % 2 == 1 || before == 0 {
            return None;
        }
        let snap = Snap {
            generation: p.generation.load(Ordering::Relaxed),
            version: p.version.load(Ordering::Relaxed),
            counts_cost: p.counts_cost.load(Ordering::Relaxed),
            name: self.name,
            interval: p.interval.load(Ordering::Relaxed),
            tolerance: p.tolerance.load(Ordering::Relaxed),
            burst: p.burst.load(Ordering::Relaxed),
        };
        std::sync::atomic::fence(Ordering::Acquire);
        (p.seq.load(Ordering::Relaxed) == before).then_some(snap)
    }

    /// Acquires `cost` at `now` without a lock, or says the mutex path must.
    #[inline]
    pub(crate) fn acquire(&self, cost: u64, now: Instant) -> Fast {
        let Some(p) = self.snap() else { return Fast::Locked };
        let cost = if p.counts_cost { cost } else { 1 };
        let stripe = &self.stripes[stripe()].0;
        if cost > p.burst {
            stripe.impossible.fetch_add(1, Ordering::Relaxed);
            return Fast::Refused(AcquireError::CostAboveCapacity(CostAboveCapacity {
                limit: p.name,
                tier: None,
                cost,
                capacity: p.burst,
            }));
        }
        let now_nanos = now.as_nanos();
        if now_nanos > TAT_MASK - MAX_TOLERANCE {
            return Fast::Locked;
        }
        let add = cost.saturating_mul(p.interval);
        let mut word = self.word.0.load(Ordering::Acquire);
        loop {
            if word == CLOSED || word >> TAT_BITS != p.generation {
                return Fast::Locked;
            }
            let tat = word & TAT_MASK;
            let new_tat = tat.max(now_nanos) + add;
            let ahead = new_tat - now_nanos;
            if ahead > p.tolerance {
                stripe.denied.fetch_add(1, Ordering::Relaxed);
                return Fast::Refused(refused(&p, tat, now, ahead - p.tolerance));
            }
            match self.word.0.compare_exchange_weak(
                word,
                (p.generation << TAT_BITS) | new_tat,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    stripe.admitted.fetch_add(1, Ordering::Relaxed);
                    stripe.latest.fetch_max(now_nanos, Ordering::Relaxed);
                    return Fast::Granted { at: now, version: p.version };
                }
                Err(current) => word = current,
            }
        }
    }

    /// Takes the state for the mutex path: the TAT, or `None` if the word was closed.
    pub(crate) fn borrow(&self) -> Option<GcraState> {
        let word = self.word.0.swap(CLOSED, Ordering::AcqRel);
        (word != CLOSED).then(|| GcraState::at(Instant::from_nanos(word & TAT_MASK)))
    }

    /// Gives the state back to the lock-free path (with the current generation), or
    /// keeps it closed when the TAT is out of its range.
    pub(crate) fn give_back(&self, state: &GcraState) {
        let tat = state.theoretical_arrival().as_nanos();
        if tat > TAT_MASK || !self.is_on() {
            return;
        }
        let generation = self.params.0.generation.load(Ordering::Relaxed);
        self.word.0.store((generation << TAT_BITS) | tat, Ordering::Release);
    }

    /// The latest instant a lock-free grant was made at.
    pub(crate) fn latest(&self) -> Instant {
        Instant::from_nanos(self.stripes.iter().map(|l| l.0.latest.load(Ordering::Relaxed)).max().unwrap_or(0))
    }

    /// Moves the lock-free path's counts out (under the set's global lock).
    pub(crate) fn drain(&self) -> Drained {
        let mut out = (0, 0, 0);
        for line in &self.stripes {
            let s = &line.0;
            out.0 += s.admitted.swap(0, Ordering::Relaxed);
            out.1 += s.denied.swap(0, Ordering::Relaxed);
            out.2 += s.impossible.swap(0, Ordering::Relaxed);
        }
        out
    }

    /// The lock-free path's counts so far, without moving them.
    pub(crate) fn counts(&self) -> Drained {
        let mut out = (0, 0, 0);
        for line in &self.stripes {
            let s = &line.0;
            out.0 += s.admitted.load(Ordering::Relaxed);
            out.1 += s.denied.load(Ordering::Relaxed);
            out.2 += s.impossible.load(Ordering::Relaxed);
        }
        out
    }
}

#[cold]
#[inline(never)]
fn refused(p: &Snap, tat: u64, now: Instant, wait: u64) -> AcquireError {
    let debt = tat.saturating_sub(now.as_nanos());
    AcquireError::Denied(Denial {
        name: p.name,
        tier: None,
        limit: 0,
        retry_after: Duration::from_nanos(wait),
        needs_release: false,
        snapshot: Snapshot {
            quota: p.burst,
            remaining: p.tolerance.saturating_sub(debt) / p.interval,
            reset: Duration::from_nanos(debt),
            window: Duration::from_nanos(p.tolerance),
        },
    })
}
