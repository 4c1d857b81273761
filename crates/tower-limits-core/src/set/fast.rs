//! The lock-free path of a set whose only limit is one global GCRA.
//!
//! # What it owns
//!
//! The commonest set is one global rate limit. Its whole state is GCRA's theoretical
//! arrival time (TAT), so here it lives in one `AtomicU64` instead of behind the global
//! lock. An acquisition loads the TAT, runs the very same [`Gcra`] decision on a copy and
//! publishes the new TAT with one compare-and-swap; a failed swap means another thread
//! admitted in between, and the decision is made again on the value it wrote. A denial
//! only loads: it computes the exact `retry_after` from the value it read and writes
//! nothing shared, so a denial costs no more than a grant.
//!
//! # The invariants
//!
//! - **One owner of the state.** While the path is *enabled* the atomic is the limit's
//!   state and the copy in the locked global states is stale; every locked operation on
//!   the limit (settle, refund, charge, align, peek) reads or compare-and-swaps the atomic
//!   instead, under the global lock, so they are serialized with each other and atomic
//!   with respect to lock-free acquisitions.
//! - **Disabled is a value.** [`DISABLED`] in the atomic means the locked state rules.
//!   [`LimitSet::replace_policy`](crate::LimitSet::replace_policy) swaps it in under all
//!   the locks and moves the last TAT into the locked state, so an acquisition that read
//!   the TAT before the swap fails its compare-and-swap and takes the locked path, which
//!   waits for the replace to finish.
//! - **The parameters never change.** They are fixed when the set is built. A replace
//!   keeps the path enabled only when the new policy is the same one global GCRA (same
//!   name, rate and burst), carrying the TAT over untouched, so an acquisition racing it
//!   decides the same under either policy. Any other replace disables the path for good;
//!   a later replace back to the original limit re-enables it with the locked TAT (an
//!   acquisition that read a value from before can only succeed on that very value, with
//!   the very same parameters, which is a decision made just before the replace).
//! - **Time.** The locked path raises `now` to the latest instant the set has seen. One
//!   such instant would be a line every grant writes, so each counter stripe keeps the
//!   latest instant of the grants counted there: an acquisition raises its `now` to its
//!   own stripe's, which makes a lone thread decide exactly as the locked path would,
//!   and the locked operations (peek, settle) raise theirs to the latest of all stripes.
//!   Across threads the raise is partial, which is safe for GCRA: the TAT never moves
//!   back, and a caller whose clock read lags decides against `max(tat, now)` with its
//!   own `now`, which can only make it wait longer.
//! - **Counters.** Grants and denials are counted in striped, padded counters picked by
//!   thread, so that far from the limit no grant writes a line another core writes.
//!   [`LimitSet::stats`](crate::LimitSet::stats) sums the stripes.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use crate::algorithm::{Algorithm, Gcra, GcraState, Refusal, Snapshot};
use crate::limit::{Config, Limit, LimitState};
use crate::policy::Counts;
use crate::time::Instant;

/// The value of the atomic while the locked state rules.
pub(super) const DISABLED: u64 = u64::MAX;

/// How many counter stripes a fast set keeps (a power of two).
const STRIPES: usize = 16;

/// One stripe of counters, on its own cache lines.
#[repr(align(128))]
#[derive(Default)]
struct Stripe {
    /// The latest instant a grant counted here was made at.
    latest: AtomicU64,
    admitted: AtomicU64,
    denied: AtomicU64,
    impossible: AtomicU64,
}

/// The lock-free state of a one-limit global GCRA set.
pub(super) struct Fast {
    tat: AtomicU64,
    /// The config version grants are stamped with.
    version: AtomicU64,
    gcra: Gcra,
    name: &'static str,
    counts: Counts,
    stripes: Box<[Stripe]>,
}

/// What the fast path decided.
pub(super) enum Decision {
    /// Granted at this instant.
    Granted(Instant, u64),
    /// Refused: the wait and the snapshot of the state read.
    Denied(Duration, Snapshot),
    /// The cost is above the burst.
    Never(u64),
}

/// The stripe of the calling thread: threads take consecutive stripes in the order they
/// first ask.
fn stripe_index() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static INDEX: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    INDEX.with(|i| {
        let mut v = i.get();
        if v == usize::MAX {
            v = NEXT.fetch_add(1, Ordering::Relaxed);
            i.set(v);
        }
        v & (STRIPES - 1)
    })
}

impl Fast {
    /// The fast state for `config`, if its only limit is one global GCRA.
    pub(super) fn for_config(config: &Config) -> Option<Fast> {
        let [def] = config.limits.as_slice() else { return None };
        let (None, Limit::Gcra(gcra)) = (def.tier, &def.limit) else { return None };
        Some(Fast {
            tat: AtomicU64::new(0),
            version: AtomicU64::new(config.version),
            gcra: *gcra,
            name: def.name,
            counts: def.counts,
            stripes: (0..STRIPES).map(|_| Stripe::default()).collect(),
        })
    }

    /// Whether `config` is the very limit this fast state was built for.
    pub(super) fn fits(&self, config: &Config) -> bool {
        matches!(config.limits.as_slice(), [def] if def.tier.is_none()
            && def.name == self.name
            && def.counts == self.counts
            && matches!(&def.limit, Limit::Gcra(g) if *g == self.gcra))
    }

    /// The cost charged for an acquisition of `uniform` cost, or of the first of `each`.
    #[inline]
    pub(super) fn cost(&self, uniform: u64) -> u64 {
        match self.counts {
            Counts::Requests => 1,
            Counts::Cost => uniform,
        }
    }

    /// The decision, or `None` when the path is disabled.
    #[inline]
    pub(super) fn acquire(&self, cost: u64, now: Instant) -> Option<Decision> {
        let stripe = self.stripe();
        let latest = stripe.latest.load(Ordering::Relaxed);
        let now = now.max(Instant::from_nanos(latest));
        let mut cur = self.tat.load(Ordering::Acquire);
        loop {
            if cur == DISABLED {
                return None;
            }
            let mut state = GcraState::at(Instant::from_nanos(cur));
            match self.gcra.acquire(&mut state, now, cost) {
                Ok(()) => {
                    let new = state.theoretical_arrival().as_nanos();
                    match self.tat.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire) {
                        Ok(_) => {
                            if now.as_nanos() > latest {
                                stripe.latest.store(now.as_nanos(), Ordering::Relaxed);
                            }
                            stripe.admitted.fetch_add(1, Ordering::Relaxed);
                            return Some(Decision::Granted(now, self.version.load(Ordering::Relaxed)));
                        }
                        Err(seen) => cur = seen,
                    }
                }
                Err(refusal) => return Some(self.refused(refusal, &state, now)),
            }
        }
    }

    #[cold]
    #[inline(never)]
    fn refused(&self, refusal: Refusal, state: &GcraState, now: Instant) -> Decision {
        match refusal {
            Refusal::NotYet { retry_after } => {
                self.stripe().denied.fetch_add(1, Ordering::Relaxed);
                Decision::Denied(retry_after.unwrap_or(Duration::ZERO), self.gcra.peek(state, now))
            }
            Refusal::Never { capacity } => {
                self.stripe().impossible.fetch_add(1, Ordering::Relaxed);
                Decision::Never(capacity)
            }
        }
    }

    #[inline]
    fn stripe(&self) -> &Stripe {
        &self.stripes[stripe_index()]
    }

    /// The limit's name.
    pub(super) fn name(&self) -> &'static str {
        self.name
    }

    /// Whether the atomic rules the state now.
    pub(super) fn enabled(&self) -> bool {
        self.tat.load(Ordering::Acquire) != DISABLED
    }

    /// The state now, for a peek. Call only while enabled, under the global lock.
    pub(super) fn state(&self) -> LimitState {
        LimitState::Gcra(GcraState::at(Instant::from_nanos(self.tat.load(Ordering::Acquire))))
    }

    /// Applies `f` to the state atomically (a correction). Call only while enabled, under
    /// the global lock (which keeps the path from being disabled meanwhile).
    pub(super) fn update(&self, mut f: impl FnMut(&mut LimitState)) {
        let mut cur = self.tat.load(Ordering::Acquire);
        loop {
            debug_assert_ne!(cur, DISABLED, "corrections run under the lock that guards disabling");
            let mut state = LimitState::Gcra(GcraState::at(Instant::from_nanos(cur)));
            f(&mut state);
            let LimitState::Gcra(s) = state else { unreachable!("a GCRA stays a GCRA") };
            // A charge saturates at the end of time, one short of `DISABLED`.
            let new = s.theoretical_arrival().as_nanos().min(DISABLED - 1);
            match self.tat.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(seen) => cur = seen,
            }
        }
    }

    /// Disables the path; returns the last state. Under all the locks.
    pub(super) fn disable(&self) -> Option<LimitState> {
        let last = self.tat.swap(DISABLED, Ordering::AcqRel);
        (last != DISABLED).then(|| LimitState::Gcra(GcraState::at(Instant::from_nanos(last))))
    }

    /// Enables the path with `state`, for a config that [`Fast::fits`]. Under all the
    /// locks.
    pub(super) fn enable(&self, state: &LimitState, version: u64) {
        let LimitState::Gcra(s) = state else { return };
        self.version.store(version, Ordering::Relaxed);
        self.tat.store(s.theoretical_arrival().as_nanos().min(DISABLED - 1), Ordering::Release);
    }

    /// The latest instant any grant of this path was made at (a grant racing this call
    /// may be missed, as a racing clock read would be).
    pub(super) fn latest(&self) -> Instant {
        Instant::from_nanos(self.stripes.iter().map(|s| s.latest.load(Ordering::Relaxed)).max().unwrap_or(0))
    }

    /// Grants, denials and impossible costs counted by the path.
    pub(super) fn counts(&self) -> (u64, u64, u64) {
        self.stripes.iter().fold((0, 0, 0), |(a, d, i), s| {
            (
                a + s.admitted.load(Ordering::Relaxed),
                d + s.denied.load(Ordering::Relaxed),
                i + s.impossible.load(Ordering::Relaxed),
            )
        })
    }

    /// Takes the counts out (at a replace, which moves them to the locked counters).
    pub(super) fn drain(&self) -> (u64, u64, u64) {
        self.stripes.iter().fold((0, 0, 0), |(a, d, i), s| {
            (
                a + s.admitted.swap(0, Ordering::Relaxed),
                d + s.denied.swap(0, Ordering::Relaxed),
                i + s.impossible.swap(0, Ordering::Relaxed),
            )
        })
    }
}
