//! The lock-free state of a set's one global rate limit: alone, or beside keyed limits.
//!
//! # What it owns
//!
//! The commonest set is one global rate limit. Its whole state is GCRA's theoretical
//! arrival time (TAT), so here it lives in one `AtomicU64` instead of behind the global
//! lock. An acquisition loads the TAT, runs the very same [`Gcra`] decision on a copy and
//! publishes the new TAT with one compare-and-swap; a failed swap means another thread
//! admitted in between, and the decision is made again on the value it wrote. A refusal
//! only loads: it computes the exact `retry_after` from the value it read and writes
//! nothing shared, so a refusal costs no more than a grant.
//!
//! A token bucket makes exactly GCRA's decisions with the same rate and burst (the two
//! are one algorithm seen from opposite ends), so a bucket is served here too, as its
//! GCRA: its state is moved in and out of the atomic through the bijection of the two
//! states (the bucket is full from the TAT on, and short of `TAT - now` of credit before),
//! and a correction applies the bucket's own refund or charge to the state it maps to.
//!
//! # Beside keyed limits
//!
//! The next commonest set is per-tenant limits under one global cap (requests per tenant
//! and tokens per minute for everyone). Under the global lock every acquisition of every
//! tenant writes that lock's line, so threads on different tenants queue on it, and two do
//! less work together than one alone. So when a set's
//! only global limit is a GCRA or a token bucket that enforces, its state lives here too,
//! and the acquisition takes the tenant's shard lock alone:
//!
//! - **Last, then nothing to undo.** The tenant's limits are checked under the shard lock
//!   first (a cost above this limit's burst is refused in its turn, as under the lock),
//!   room is made for new keys, and only then is this limit acquired, in one step. If it
//!   refuses, nothing has been written; if it grants, the tenant's limits are committed
//!   under the same lock, which cannot fail. All or nothing holds as before.
//! - **The wait covers everything.** A refusal by a tenant's limit also reads this
//!   limit's TAT (a load), so that the wait it names is the one after which every limit
//!   would pass, and of equal waits the later limit in the policy names the refusal.
//! - **No race with a replace.** Every acquisition of such a set holds a shard lock (or
//!   the global lock, for the global key), and a replace takes them all, so the path is
//!   never enabled or disabled under an acquisition.
//! - **Time.** The global lock raised every decision to the latest instant the set had
//!   seen. Here a thread raises its `now` to its own stripe's latest instant, so a thread
//!   that read the clock and then lost its core for a time slice would find the TAT moved
//!   past its `now` by more than the tolerance, and be refused with the limit far from
//!   exhausted. So a refusal on a limit that threads contend for is decided again at the
//!   latest instant of all stripes (only then: a lone thread's own instants are the
//!   latest), which is the answer the lock gave.
//! - **Counted by the set.** Grants are the set's, and the set counts the refusals it
//!   answers with in its shards' counters, so only the final decision is counted.
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
//!   keeps the path enabled only when the new policy has the very same limit in the same
//!   role (same name, algorithm, rate, burst and place, alone or beside keyed limits),
//!   carrying the TAT over untouched, so an acquisition racing it
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
//!   own `now`, which can only make it wait longer. When it lags so far behind another
//!   thread's grant that the TAT lies more than the tolerance past its `now` (no grant
//!   leaves the TAT that far past its own instant), its refusal is decided again at the
//!   latest instant of all stripes, as the lock would have decided it (and the count the
//!   refusal made is taken back, so the call is counted once): a thread that lost its
//!   core between its clock read and its decision is not refused with the limit far from
//!   exhausted. A refusal that is not that far is answered at once, and costs no read of
//!   the stripes.
//! - **Counters.** Alone, grants and refusals are counted in striped, padded counters picked by
//!   thread, so that far from the limit no grant writes a line another core writes.
//!   [`LimitSet::stats`](crate::LimitSet::stats) sums the stripes (in [`stripes`]). The
//!   first [`OWNED_STRIPES`](stripes::OWNED_STRIPES) stripes each belong to at most one
//!   live thread at a time, which adds with a plain load and store (no locked
//!   instruction): nobody else writes them.
//!   A thread claims a free one when it first acquires and gives it back when it exits,
//!   so a process that keeps starting threads (a blocking pool, a benchmark) does not run
//!   out of them. Threads beyond that many at once count in the other stripes, shared,
//!   with atomic adds. Stripes are never reset, so a new owner carries the counts on.
//!
//! # Leases: no collapse on many cores
//!
//! One TAT that every grant swaps is one cache line every core writes: past a few cores
//! the line's travels cost more than the decisions. So a thread that has seen its swap
//! fail (and only then: a lone thread never leases, and decides exactly as plain GCRA)
//! takes *leases*: with its grant (which ends at `g`) it advances the shared TAT further,
//! to `s + k*T` for `k` more units beginning at some `s >= g`, and keeps them in a
//! thread-local slot. Later calls of that thread use the leased units without touching any
//! shared line: a few loads from the slot and one store to it, in line in the caller, each
//! of its fields a word of its own: a whole slot copied out and back on every call, or
//! the call out of line, costs more than the shared write the lease saves. The
//! slots between `g` and `s` (the *lead*, below) belong to no one.
//!
//! Until some thread sees its swap fail no thread can hold a lease, so a flag on the
//! read-mostly line (set once, by the first failed swap) keeps the leases out of the lone
//! thread's path altogether: its acquisition is the stripe, one load, the decision and one
//! compare-and-swap.
//!
//! **Why it cannot over-admit.** Taking a lease is admitting its `k` units at once, at the
//! instant `t0` the lease was taken, under the unchanged GCRA rule `s + k*T - t0 <= tau`
//! (the lead counts against the headroom as if it were units).
//! Unit `j` of the lease owns the slot `[s + j*T, s + (j+1)*T)`, and a thread may use it at
//! instant `t` only while the slot has not begun (`s + j*T >= t`) and never before the
//! lease was taken (`t >= t0`; a later call's `now` is raised to `t0`). So every unit
//! granted, leased or not, owns a slot of length `T` of its own that starts no earlier
//! than its grant and ends no later than `t0 + tau <= t + tau`. For the grants whose
//! instants lie in a window `[a, b]`, those disjoint slots all lie in `[a, b + tau]`:
//! there are at most `(b - a + tau) / T` of them, the very cap of plain GCRA. Unused units
//! go back only by a compare-and-swap of the TAT from the lease's end to its next unit
//! (or, when none of its units was used, to where its lead began), which succeeds only if
//! nobody advanced the TAT since: then the returned slots were never used by anyone, and
//! the TAT is back at the lease's first unused slot (the lead before a lease partly used
//! stays spent).
//!
//! **Sizing.** A lease takes a quarter of the headroom left after the grant and its lead,
//! at most the thread's *lease size*, in grants of the cost of the call that takes it,
//! and always a whole number of them: far from the limit a thread takes that many grants
//! per shared write; near it the quarter rounds down to no grant and every decision is
//! the exact, shared one. A thread's size starts at [`FIRST_LEASE`] grants, doubles each
//! time a lease is used to its last unit, each before its slot began (the thread asks
//! fast enough to use more), up to [`MAX_LEASE`], and halves, not below [`FIRST_LEASE`],
//! each time one ends with a slot begun unused. A lease with too few units left for the
//! cost of a call ends there, and leaves the size as it was. So on many cores the shared
//! word sees one write per [`MAX_LEASE`] grants of each fast thread, whatever the grants
//! cost (a token limit's calls cost hundreds of units each), and a slow thread strands no
//! more than it did.
//!
//! **Leading the clock.** A unit must be used before its slot begins. Far from the limit
//! the TAT lags the clock, so a lease taken there begins at the clock, and when the
//! emission interval is shorter than the thread's own pace between calls (a limit of a
//! billion per second, a thread asking every 20 ns) its slots begin long before they are
//! used: the lease would be lost. So each lease, when it ends (used up, or with a slot
//! begun unused), teaches its thread its pace: `u` nanoseconds of slots used in `e`
//! nanoseconds of clock (at least one unit's, if it used none). The thread's next lease
//! begins `lead = 2 * size * T * (e - u) / u` past the clock (nothing when `e <= u`:
//! the slots go by slower than the thread uses them), at most a quarter of the headroom:
//! the slack a whole lease would build up at that pace, twice over. The TAT is pushed
//! ahead only up to `now + lead`; once it is that far ahead, leases follow one another with
//! no gap. What a lead costs is burst: while threads lease, the TAT runs at most `lead`
//! ahead of the clock (a few microseconds at the benchmark's pace), and those slots are
//! capacity nobody uses. A thread whose lease expired although it led the clock (its pace
//! is too slow for any lead the headroom allows) stops leasing for [`COOLDOWN`] calls and
//! decides on the shared TAT, exactly; before giving units back it reads the TAT, so a
//! lease that cannot be returned costs no write.
//!
//! **Worst case.** Units leased and not used are stranded: other threads see them as
//! spent. With `n` threads, at most `n * (MAX_LEASE - 1)` grants' worth of units are out
//! at once (and only threads that used up their last leases hold leases that large), and
//! since each lease takes a quarter of what is left, at most `1 - (3/4)^n` of the headroom
//! at that moment; the leads add at most as much again (each a quarter of what is left).
//! A stranded unit is lost for good only once its slot begins unused (it then frees
//! nothing and costs nothing more). A thread that leaves, or leases another
//! limit whose id maps to the same of its [`LEASE_SLOTS`] slots, strands its lease the
//! same way. While leases
//! are out, `peek`'s `remaining` (and a refusal's retry) reads the shared TAT, so it
//! counts leased units as used: it under-reports by at most the stranded units, never
//! over-reports. A replace voids every lease (the epoch moves), stranding them too, and so
//! does a settle or refund that moves the shared TAT under a lease: the lease can no
//! longer be given back, and its unused units stay spent until time passes their slots.
//! All of this wastes capacity for a while; none of it can admit a unit more.
//!
//! # How it is checked
//!
//! - Deterministic unit tests (`fast/tests.rs`) drive one thread's leases through each
//!   rule: sizing, the lead and its cap, give-back, cooldown, epochs.
//! - Real threads (`tests/tests/lock_free.rs` and `leasing_threads_never_over_admit`)
//!   hammer one limit and check the rate cap over every window of the grants.
//! - Loom models (`fast/loom_models.rs`, run under `--cfg loom`) go through every
//!   interleaving, within two preemptions, of two threads' acquisitions at one instant
//!   and over time, of a give-back racing a grant, and of a replace racing them. They
//!   check the cap, the invariant that every unit granted owns a slot of its own between
//!   the first grant and the TAT, and (by taking every unit left at the end) that no
//!   slot is handed out twice.

use std::sync::atomic::Ordering;

// The atomics of the protocol: loom's under `--cfg loom`, whose models (in `loom_models`)
// check every interleaving (within two preemptions) of a few threads' acquisitions,
// leases and replaces.
#[cfg(loom)]
use loom::sync::atomic::{AtomicBool, AtomicU64};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::Duration;

use crate::algorithm::{Algorithm, Gcra, GcraState, Refusal, Snapshot};
use crate::error::LimitRefusal;
use crate::limit::{Config, Limit, LimitState};
use crate::policy::Counts;
use crate::time::Instant;
use lease::LEASES;
use stripes::{STRIPES, Stripe, bump, stripe, unbump};

/// The value of the atomic while the locked state rules.
pub(super) const DISABLED: u64 = u64::MAX;

/// A decision in two words: `(granted at, GRANTED)`, `(capacity, NEVER)`, `(_, OFF)`, or
/// `(at, tat)` for a refusal on the TAT read (which never reaches [`MAX_TAT`]).
#[derive(Clone, Copy)]
struct Packed(u64, u64);

const GRANTED: u64 = u64::MAX;
const NEVER: u64 = u64::MAX - 1;
const OFF: u64 = u64::MAX - 2;

/// The furthest a TAT is ever stored at, below the markers above.
const MAX_TAT: u64 = u64::MAX - 3;

/// The lock-free state of a one-limit global GCRA set.
pub(super) struct Fast {
    tat: Line,
    /// Unique among the limits of this process: names this one's leases.
    id: u64,
    /// Bumped by every disable, voiding the leases taken before.
    epoch: AtomicU64,
    tolerance: u64,
    /// The quota and window a snapshot reports ([`Snapshot::rate_quota`]).
    quota: u64,
    window_nanos: u64,
    /// The config version grants are stamped with.
    version: AtomicU64,
    /// The decisions, as GCRA's (a token bucket's are the same).
    gcra: Gcra,
    /// The limit as the policy gives it, and its index there.
    limit: Limit,
    index: usize,
    /// Whether the limit is the set's only one (the path taken before any lock), or the
    /// one global limit beside keyed ones (decided under the tenant's shard lock).
    alone: bool,
    name: &'static str,
    counts: Counts,
    /// Set for good the first time any thread sees its swap fail: until then no thread
    /// can hold a lease, and acquisitions skip the leases altogether.
    contended: AtomicBool,
    stripes: Box<[Stripe; STRIPES]>,
}

/// What the fast path decided.
pub(super) enum Decision {
    /// Granted at this instant.
    Granted(Instant, u64),
    /// Refused on the TAT read at the instant given (see [`Fast::refusal`]); kept small
    /// so that the refusal is built once, in place.
    Refused(u64, Instant),
    /// The cost is above the burst.
    Never(u64),
}

/// The TAT, alone on its cache lines: the read-mostly fields beside it stay shared.
#[repr(align(128))]
struct Line(AtomicU64);

impl Fast {
    /// The limit of `config` a fast state can serve: its one global limit, when that is
    /// an enforcing GCRA or token bucket and every other limit is keyed.
    fn candidate(config: &Config) -> Option<usize> {
        let mut globals = config.limits.iter().enumerate().filter(|(_, def)| def.tier.is_none());
        let (index, def) = globals.next()?;
        let rate = matches!(def.limit, Limit::Gcra(_) | Limit::TokenBucket(_));
        (globals.next().is_none() && rate && !def.shadow).then_some(index)
    }

    /// The fast state for `config`, if it has a limit one can serve (see the module's
    /// opening).
    pub(super) fn for_config(config: &Config) -> Option<Fast> {
        let index = Fast::candidate(config)?;
        let def = &config.limits[index];
        let gcra = match &def.limit {
            Limit::Gcra(gcra) => *gcra,
            Limit::TokenBucket(bucket) => Gcra::new(bucket.quota()),
            _ => return None,
        };
        static IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let (quota, window) = Snapshot::rate_quota(gcra.quota());
        Some(Fast {
            tat: Line(AtomicU64::new(0)),
            id: IDS.fetch_add(1, Ordering::Relaxed),
            epoch: AtomicU64::new(0),
            tolerance: gcra.interval_nanos() * gcra.quota().max_burst(),
            quota,
            window_nanos: crate::error::nanos(window),
            version: AtomicU64::new(config.version),
            gcra,
            limit: def.limit.clone(),
            index,
            alone: config.limits.len() == 1,
            name: def.name,
            counts: def.counts,
            contended: AtomicBool::new(false),
            stripes: Box::new(std::array::from_fn(|_| Stripe::default())),
        })
    }

    /// Whether `config` has the very limit this fast state was built for, at the same
    /// index and in the same role.
    pub(super) fn fits(&self, config: &Config) -> bool {
        Fast::candidate(config) == Some(self.index)
            && (config.limits.len() == 1) == self.alone
            && config
                .limits
                .get(self.index)
                .is_some_and(|def| def.name == self.name && def.counts == self.counts && def.limit == self.limit)
    }

    /// Whether this is the path of a set whose only limit this is.
    pub(super) fn alone(&self) -> bool {
        self.alone
    }

    /// The limit's index in the policy.
    pub(super) fn index(&self) -> usize {
        self.index
    }

    /// How long `cost` would wait now, read off the shared TAT (writing nothing), or
    /// `None` if it would pass. For a refusal by another limit of the set, whose wait
    /// must cover this one's too.
    pub(super) fn wait(&self, cost: u64, now: Instant) -> Option<Duration> {
        let tat = self.tat.0.load(Ordering::Acquire).min(MAX_TAT);
        match self.gcra.check(&GcraState::at(Instant::from_nanos(tat)), now, cost) {
            Err(Refusal::NotYet { retry_after }) => retry_after,
            _ => None,
        }
    }

    /// The limit's state with theoretical arrival time `tat`, as the policy's algorithm
    /// keeps it.
    fn state_at(&self, tat: u64) -> LimitState {
        match &self.limit {
            Limit::TokenBucket(bucket) => LimitState::TokenBucket(bucket.state_full_at(Instant::from_nanos(tat))),
            _ => LimitState::Gcra(GcraState::at(Instant::from_nanos(tat))),
        }
    }

    /// The theoretical arrival time of `state` (the inverse of [`Fast::state_at`]).
    fn tat_of(&self, state: &LimitState) -> Option<u64> {
        let tat = match (&self.limit, state) {
            (Limit::TokenBucket(bucket), LimitState::TokenBucket(s)) => bucket.full_at(s),
            (Limit::Gcra(_), LimitState::Gcra(s)) => s.theoretical_arrival(),
            _ => return None,
        };
        // A charge saturates at the end of time, short of the markers.
        Some(tat.as_nanos().min(MAX_TAT))
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
    #[inline(always)]
    pub(super) fn acquire(&self, cost: u64, now: Instant) -> Option<Decision> {
        // Unpacked here, in the caller: two words come back in registers, an enum would
        // come back through memory.
        let Packed(a, b) = self.decide_packed(cost, now);
        match b {
            GRANTED => Some(Decision::Granted(Instant::from_nanos(a), self.version.load(Ordering::Relaxed))),
            NEVER => Some(Decision::Never(a)),
            OFF => None,
            tat if self.lagged(tat, a) => self.decide_at_latest(cost, tat, Instant::from_nanos(a)),
            tat => Some(Decision::Refused(tat, Instant::from_nanos(a))),
        }
    }

    /// Whether a refusal on the TAT `tat` at `now` (nanoseconds) can only come from a
    /// clock read that lagged: every grant leaves the TAT at most the tolerance past its
    /// own instant, so a TAT further than that past `now` was written by a grant decided
    /// at a later instant than this call's (or by a charge that settled more than a grant
    /// took). A refusal's TAT is always past its instant (the cost is within the burst, so
    /// only a TAT ahead can refuse it): the difference cannot wrap, and if it did, the call
    /// would only be decided again at the latest instant, as the lock decided every call.
    #[inline(always)]
    fn lagged(&self, tat: u64, now: u64) -> bool {
        tat.wrapping_sub(now) > self.tolerance
    }

    /// The answer to a call whose clock read lagged: decided again at the latest instant
    /// of any grant, as the global lock's latest instant decided it. Another thread read
    /// the clock, then lost its core for a while, and meanwhile the others' grants (and,
    /// under contention, their leases and leads) moved the TAT more than the tolerance
    /// past its instant: refused there, though the limit was far from exhausted (a
    /// contended limit with a burst of a millisecond is enough). Counted once, as what it finally is: the refusal counted
    /// where it was made is taken back when the call is decided again.
    #[cold]
    #[inline(never)]
    fn decide_at_latest(&self, cost: u64, mut tat: u64, mut at: Instant) -> Option<Decision> {
        // Each round decides at a later instant than the last; a few are plenty (the
        // others would have to keep granting later and later in between).
        for _ in 0..4 {
            let latest = self.latest();
            if latest <= at {
                break;
            }
            if self.alone {
                // This thread's stripe, where the refusal was counted a moment ago.
                let (index, own) = stripe();
                unbump(&self.stripes[index].refused, own);
            }
            let Packed(a, b) = self.decide_packed(cost, latest);
            match b {
                GRANTED => {
                    return Some(Decision::Granted(Instant::from_nanos(a), self.version.load(Ordering::Relaxed)));
                }
                NEVER => return Some(Decision::Never(a)),
                // A replace disabled the path meanwhile (the path alone takes no lock):
                // the locked path decides, and counts.
                OFF => return None,
                // Refused again: at a still later instant, if some grant was made there.
                again => (tat, at) = (again, Instant::from_nanos(a)),
            }
        }
        Some(Decision::Refused(tat, at))
    }

    /// The plain GCRA decision on the shared TAT `cur` at `now`: the TAT a grant stores,
    /// or the answer to give at once (the path is off, or the limit refuses).
    #[inline(always)]
    fn decide_on(&self, cur: u64, cost: u64, now: u64, at: (&Stripe, bool)) -> Result<u64, Packed> {
        if cur == DISABLED {
            return Err(Packed(0, OFF));
        }
        let mut state = GcraState::at(Instant::from_nanos(cur));
        if let Err(refusal) = self.gcra.acquire(&mut state, Instant::from_nanos(now), cost) {
            return Err(self.refused(refusal, &state, Instant::from_nanos(now), at));
        }
        Ok(state.theoretical_arrival().as_nanos())
    }

    #[inline(always)]
    fn decide_packed(&self, cost: u64, now: Instant) -> Packed {
        let (index, own) = stripe();
        let stripe = &self.stripes[index];
        let latest = stripe.latest.load(Ordering::Relaxed);
        let now = now.max(Instant::from_nanos(latest)).as_nanos();
        if !self.contended.load(Ordering::Relaxed) {
            // No thread has ever seen a swap fail, so none holds a lease: one decision on
            // the shared TAT, as plain GCRA, with no thread-local state but the stripe.
            let cur = self.tat.0.load(Ordering::Acquire);
            let granted = match self.decide_on(cur, cost, now, (stripe, own)) {
                Ok(granted) => granted,
                Err(answer) => return answer,
            };
            if self.tat.0.compare_exchange(cur, granted, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                return self.granted(stripe, own, latest, now);
            }
            // Another thread admitted in between: from now on every thread looks at its
            // leases, and this one counts as having seen contention.
            self.contended.store(true, Ordering::Relaxed);
            LEASES.with(|leases| self.mark_seen(&leases[self.slot()]));
        }
        // A unit of this thread's lease, if it has one left for this cost: here, in line,
        // as every call under contention goes; the rest (no lease, or one that ended) out
        // of line.
        let leased = LEASES.with(|leases| {
            let entry = &leases[self.slot()];
            if !self.owns(entry) {
                return None;
            }
            // A unit may be used only while its slot has not begun: `next >= now`.
            let need = cost.saturating_mul(self.gcra.interval_nanos());
            let now = now.max(entry.taken.get());
            let (next, end) = (entry.next.get(), entry.end.get());
            (next >= now && end - next >= need).then(|| {
                entry.next.set(next + need);
                now
            })
        });
        if let Some(now) = leased {
            return self.granted(stripe, own, latest, now);
        }
        self.decide_leased(cost, now, latest, (stripe, own))
    }

    #[inline]
    fn granted(&self, stripe: &Stripe, own: bool, latest: u64, now: u64) -> Packed {
        if now > latest {
            stripe.latest.store(now, Ordering::Relaxed);
        }
        bump(&stripe.admitted, own);
        Packed(now, GRANTED)
    }

    #[inline]
    fn refused(&self, refusal: Refusal, state: &GcraState, now: Instant, stripe: (&Stripe, bool)) -> Packed {
        // Beside keyed limits, the set counts the refusals it answers with (a refusal
        // here may be decided again at a later instant, see `decide_again_if_contended`).
        match refusal {
            Refusal::NotYet { .. } => {
                if self.alone {
                    bump(&stripe.0.refused, stripe.1);
                }
                Packed(now.as_nanos(), state.theoretical_arrival().as_nanos())
            }
            Refusal::Never { capacity } => {
                if self.alone {
                    bump(&stripe.0.impossible, stripe.1);
                }
                Packed(capacity, NEVER)
            }
        }
    }

    /// The refusal of `cost` on `tat` at `now`, with its exact wait and snapshot.
    #[inline]
    pub(super) fn refusal(&self, tat: u64, now: Instant, cost: u64) -> LimitRefusal {
        // GCRA's own refusal, on the TAT the decision read: the cost would end `ahead` of
        // `now`, past the tolerance by the wait.
        let now_nanos = now.as_nanos();
        let ahead = tat.max(now_nanos).saturating_add(cost.saturating_mul(self.gcra.interval_nanos())) - now_nanos;
        let retry_nanos = ahead.saturating_sub(self.tolerance);
        if cost != 1 {
            let snapshot = self.gcra.peek(&GcraState::at(Instant::from_nanos(tat)), now);
            return LimitRefusal::new(self.name, None, self.index, Duration::from_nanos(retry_nanos), false, snapshot);
        }
        // Refused one unit: nothing remains, and the quota is the one worked out when the
        // set was built.
        LimitRefusal {
            name: self.name,
            tier: None,
            limit: self.index,
            retry_nanos,
            needs_release: false,
            quota: self.quota,
            remaining: 0,
            reset_nanos: tat.saturating_sub(now_nanos),
            window_nanos: self.window_nanos,
        }
    }

    /// The limit's state now, as a snapshot for an answer's headers: one load of the TAT.
    pub(super) fn observe(&self, now: Instant) -> super::LimitSnapshot {
        let tat = self.tat.0.load(Ordering::Acquire);
        super::LimitSnapshot {
            name: self.name,
            tier: None,
            counts: self.counts,
            is_semaphore: false,
            snapshot: self.gcra.peek(&GcraState::at(Instant::from_nanos(tat.min(MAX_TAT))), now),
        }
    }

    /// The limit's name.
    pub(super) fn name(&self) -> &'static str {
        self.name
    }

    /// Whether the atomic rules the state now.
    pub(super) fn enabled(&self) -> bool {
        self.tat.0.load(Ordering::Acquire) != DISABLED
    }

    /// Applies `f` to the state atomically (a correction). Call only while enabled, under
    /// the global lock (which keeps the path from being disabled meanwhile).
    pub(super) fn update(&self, mut f: impl FnMut(&mut LimitState)) {
        let mut cur = self.tat.0.load(Ordering::Acquire);
        loop {
            debug_assert_ne!(cur, DISABLED, "corrections run under the lock that guards disabling");
            let mut state = self.state_at(cur);
            f(&mut state);
            let new = self.tat_of(&state).unwrap_or(cur);
            match self.tat.0.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(seen) => cur = seen,
            }
        }
    }

    /// Disables the path; returns the last state. Under all the locks.
    pub(super) fn disable(&self) -> Option<LimitState> {
        self.epoch.fetch_add(1, Ordering::AcqRel);
        let last = self.tat.0.swap(DISABLED, Ordering::AcqRel);
        (last != DISABLED).then(|| self.state_at(last))
    }

    /// Enables the path with `state`, for a config that [`Fast::fits`]. Under all the
    /// locks.
    pub(super) fn enable(&self, state: &LimitState, version: u64) {
        let Some(tat) = self.tat_of(state) else { return };
        self.version.store(version, Ordering::Relaxed);
        self.tat.0.store(tat, Ordering::Release);
    }

    /// A refusal of the limit beside keyed limits, `Refused(tat, at)`, decided again
    /// ([`Fast::decide_at_latest`]) once the limit has seen a failed compare-and-swap:
    /// then a refusal may come from a clock read that lagged behind another thread's
    /// grant, even within the tolerance, and under the global lock every decision was
    /// raised to the latest instant the set had seen. A lone thread's own instants are
    /// already the latest (its stripe raises them), so until then the refusal stands.
    pub(super) fn decide_again_if_contended(&self, cost: u64, tat: u64, at: Instant) -> Option<Decision> {
        if self.contended.load(Ordering::Relaxed) {
            self.decide_at_latest(cost, tat, at)
        } else {
            Some(Decision::Refused(tat, at))
        }
    }

    /// The latest instant any grant of this path was made at (a grant racing this call
    /// may be missed, as a racing clock read would be).
    pub(super) fn latest(&self) -> Instant {
        Instant::from_nanos(self.stripes.iter().map(|s| s.latest.load(Ordering::Relaxed)).max().unwrap_or(0))
    }

    /// Grants, refusals and impossible costs counted by the path.
    pub(super) fn counts(&self) -> (u64, u64, u64) {
        self.stripes.iter().fold((0, 0, 0), |(a, d, i), s| {
            (
                a + s.admitted.load(Ordering::Relaxed),
                d + s.refused.load(Ordering::Relaxed),
                i + s.impossible.load(Ordering::Relaxed),
            )
        })
    }
}

mod lease;
mod stripes;

#[cfg(test)]
mod laws;
#[cfg(all(test, loom))]
mod loom_models;
#[cfg(all(test, not(loom)))]
mod tests;
