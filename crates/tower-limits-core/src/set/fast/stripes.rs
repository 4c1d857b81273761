//! The counters of the lock-free path: a stripe of them per thread, on lines of its own.
//!
//! A thread claims one of the owned stripes when it first counts, writes it with plain
//! stores, and gives it back when it exits; threads beyond the owned stripes at once count
//! in shared stripes, with atomic adds. Loom models share one stripe (the counters are no
//! part of the laws they check).

use std::cell::Cell;
use std::sync::atomic::Ordering;

#[cfg(loom)]
use loom::sync::atomic::AtomicU64;
#[cfg(not(loom))]
use std::sync::atomic::AtomicU64;

/// How many counter stripes a thread can own (at most 32: one bit each in [`CLAIMED`]).
pub(super) const OWNED_STRIPES: usize = 16;

/// How many counter stripes a fast set keeps: the owned ones, then as many shared (a
/// power of two).
pub(super) const STRIPES: usize = 2 * OWNED_STRIPES;

const _: () = assert!(OWNED_STRIPES < 32, "the owned stripes fit the claims' word");

/// Which owned stripes live threads hold (bit `i`: stripe `i`).
#[cfg(not(loom))]
static CLAIMED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// One stripe of counters, on its own cache lines.
#[repr(align(128))]
#[derive(Default)]
pub(super) struct Stripe {
    /// The latest instant a grant counted here was made at.
    pub(super) latest: AtomicU64,
    pub(super) admitted: AtomicU64,
    pub(super) refused: AtomicU64,
    pub(super) impossible: AtomicU64,
}

#[cfg(not(loom))]
thread_local! {
    /// This thread's counter stripe (`usize::MAX`: none yet).
    pub(super) static STRIPE: Cell<usize> = const { Cell::new(usize::MAX) };
}

// Under loom, each modelled thread starts every execution with a fresh one.
#[cfg(loom)]
loom::thread_local! {
    pub(super) static STRIPE: Cell<usize> = Cell::new(usize::MAX);
}

/// The stripe of this thread, and whether it is this thread's alone (an owned stripe).
#[inline]
pub(super) fn stripe() -> (usize, bool) {
    let v = STRIPE.with(Cell::get);
    let v = if v == usize::MAX { first_stripe() } else { v };
    // Every stripe a thread is given is below `STRIPES`: the mask changes nothing but
    // spares the bounds check of the index.
    (v & (STRIPES - 1), v < OWNED_STRIPES)
}

/// Gives a thread's owned stripe back when the thread exits.
#[cfg(not(loom))]
struct Claim(Cell<Option<usize>>);

#[cfg(not(loom))]
impl Drop for Claim {
    fn drop(&mut self) {
        if let Some(i) = self.0.take() {
            // Anything this thread still counts (another thread-local's destructor) goes
            // to a shared stripe from now on.
            STRIPE.with(|s| s.set(OWNED_STRIPES));
            // Release: the next owner's claim sees every count made here.
            CLAIMED.fetch_and(!(1 << i), Ordering::Release);
        }
    }
}

#[cfg(not(loom))]
thread_local! {
    /// Touched once, when the thread claims a stripe, so that its exit gives it back.
    static CLAIM: Claim = const { Claim(Cell::new(None)) };
}

/// The stripe of a thread that has none yet: a free owned one, claimed until the thread
/// exits, or else a shared one.
#[cold]
fn first_stripe() -> usize {
    #[cfg(not(loom))]
    static NEXT_SHARED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    #[cfg(not(loom))]
    let v = claim().unwrap_or_else(|| shared_stripe(NEXT_SHARED.fetch_add(1, Ordering::Relaxed)));
    // Under loom every modelled thread shares one stripe: which stripes are free, or
    // whose turn it is, would carry over from one execution of a model to the next (the
    // counters are no part of the laws the models check).
    #[cfg(loom)]
    let v = OWNED_STRIPES;
    STRIPE.with(|s| s.set(v));
    v
}

/// The shared stripe of the `n`-th thread to find no owned stripe free.
#[cfg_attr(loom, allow(dead_code))]
pub(super) fn shared_stripe(n: usize) -> usize {
    OWNED_STRIPES + n % OWNED_STRIPES
}

/// Claims a free owned stripe for this thread, to be given back when it exits.
#[cfg(not(loom))]
fn claim() -> Option<usize> {
    if CLAIM.try_with(|_| ()).is_err() {
        // The thread is exiting: nothing would give a stripe back.
        return None;
    }
    let mut cur = CLAIMED.load(Ordering::Relaxed);
    loop {
        let free = !cur & ((1u32 << OWNED_STRIPES) - 1);
        if free == 0 {
            return None;
        }
        let i = free.trailing_zeros() as usize;
        // Acquire: this thread sees every count the stripe's last owner made.
        match CLAIMED.compare_exchange_weak(cur, cur | 1 << i, Ordering::Acquire, Ordering::Relaxed) {
            Ok(_) => {
                // Alive: looked at above, in this very call.
                let _ = CLAIM.try_with(|c| c.0.set(Some(i)));
                return Some(i);
            }
            Err(seen) => cur = seen,
        }
    }
}

/// Adds one to a counter: a plain load and store on a stripe this thread owns, an atomic
/// add on a shared one.
#[inline]
pub(super) fn bump(counter: &AtomicU64, own: bool) {
    if own {
        counter.store(counter.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    } else {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Takes back one that [`bump`] added on this thread, on the same stripe.
#[cold]
pub(super) fn unbump(counter: &AtomicU64, own: bool) {
    if own {
        counter.store(counter.load(Ordering::Relaxed).saturating_sub(1), Ordering::Relaxed);
    } else {
        counter.fetch_sub(1, Ordering::Relaxed);
    }
}
