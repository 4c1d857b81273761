//! The state every service of one layer shares: the backend, the clock, the settings and
//! the waiters.
//!
//! With a `max_wait`, a refused request may wait instead of failing: how waiters queue
//! and who wakes them is the [waiting machine](crate::wait).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tower_limits_core::{LimitSet, LimitSetPolicy, Scope, TenantKey};

use crate::clock::LayerClock;
use crate::error::LimitError;
use crate::meter::Meter;
use crate::wait::Waiters;

/// What to do with the cost charged for a request that did not complete normally.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Unfinished {
    /// Give it back: the request is treated as if it never happened.
    Refund,
    /// Keep it charged: the work may have been done.
    #[default]
    Keep,
}

#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) default_key: Option<TenantKey>,
    pub(crate) max_wait: Option<Duration>,
    pub(crate) max_waiters: usize,
    pub(crate) on_error: Unfinished,
    pub(crate) on_cancel: Unfinished,
    /// Decide and record, never refuse.
    pub(crate) shadow: bool,
    /// Where decisions are reported (nothing without the `metrics` feature).
    pub(crate) meter: Meter,
    /// The least time between the places told to clients refused by a concurrency limit.
    pub(crate) retry_spacing: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            default_key: None,
            max_wait: None,
            max_waiters: 10_000,
            on_error: Unfinished::Keep,
            on_cancel: Unfinished::Keep,
            shadow: false,
            meter: Meter::default(),
            retry_spacing: Duration::ZERO,
        }
    }
}

/// How long the layer's concurrency permits have been held lately: the wait a
/// concurrency refusal suggests, when nothing else can say when a permit comes back.
///
/// An exponentially weighted mean (weight 1/8) of the hold times, written on one release
/// in eight at most (chosen by the low bits of the hold time), so that releases on many
/// cores do not all write one cache line; read on refusals only.
///
/// Refused clients are told successive places rather than one instant: a virtual queue
/// per key (hashed into a few dozen buckets, so that tenants seldom share one) hands out
/// places `turn / c` apart for a limit of `c` permits, where a turn is the mean hold and
/// a quarter, and never sooner than one turn away. When the service behind the layer is
/// what binds (an upstream's rate), the hold times grow only once its queue has formed,
/// too late for the clients already told; a layer that knows that service's pace spaces
/// the places at least that far apart (`retry_spacing`). A client refused again joins the end
/// of the queue; a queue whose places have all passed starts over a turn from now.
#[derive(Debug)]
pub(crate) struct HoldTimes {
    /// The mean in nanoseconds; 0 before the first sample.
    mean_ns: AtomicU64,
    /// Per bucket of keys: the time, in the layer clock's nanoseconds, of the next place
    /// to tell a refused client.
    next_place_ns: [AtomicU64; QUEUES],
}

/// Buckets of keys, each with its own queue of refused clients.
const QUEUES: usize = 64;

impl Default for HoldTimes {
    fn default() -> Self {
        HoldTimes { mean_ns: AtomicU64::new(0), next_place_ns: std::array::from_fn(|_| AtomicU64::new(0)) }
    }
}

impl HoldTimes {
    /// Takes `held` into the mean, for one release in eight (every release until the
    /// first sample).
    pub(crate) fn record(&self, held: Duration) {
        let ns = u64::try_from(held.as_nanos()).unwrap_or(u64::MAX).max(1);
        let old = self.mean_ns.load(Ordering::Relaxed);
        if old != 0 && ns & 0b111 != 0 {
            return;
        }
        // A lost update between racing writers costs one sample, never the estimate.
        let new = if old == 0 { ns } else { old - old / 8 + ns / 8 };
        self.mean_ns.store(new.max(1), Ordering::Relaxed);
    }

    /// The wait a concurrency refusal of `key` at `now` suggests, for a limit of
    /// `capacity` permits: its place in the queue of refused clients, places at least
    /// `spacing` apart (see the type's docs). `None` before a permit came back.
    pub(crate) fn turn(
        &self,
        key: Option<&TenantKey>,
        capacity: u64,
        spacing: Duration,
        now_ns: u64,
    ) -> Option<Duration> {
        let mean = self.mean_ns.load(Ordering::Relaxed);
        if mean == 0 {
            return None;
        }
        let bucket = key.map_or(0, |k| {
            use std::hash::BuildHasher;
            (std::hash::BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default().hash_one(k)
                % QUEUES as u64) as usize
        });
        // A turn a quarter longer than the mean hold: permits come back around the mean,
        // some later, and turns as long as the mean would send each wave of clients for
        // its permits just before the wave ahead of it gives them back.
        let turn = mean.saturating_add(mean / 4);
        let spacing = u64::try_from(spacing.as_nanos()).unwrap_or(u64::MAX);
        let step = (turn / capacity.max(1)).max(spacing).max(1);
        let earliest = now_ns.saturating_add(turn);
        let mut slot = earliest;
        // The next free place: after every place already told, never before one turn.
        let _ = self.next_place_ns[bucket].fetch_update(Ordering::Relaxed, Ordering::Relaxed, |next| {
            slot = next.max(earliest);
            Some(slot.saturating_add(step))
        });
        Some(Duration::from_nanos(slot - now_ns).min(MAX_TURN))
    }
}

/// The longest wait a concurrency refusal suggests by its turn.
const MAX_TURN: Duration = Duration::from_secs(60);

/// Counters of a limit layer (the limits keep their own).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerStats {
    /// Requests refused (all reasons).
    pub refused: u64,
    /// Requests that waited before being admitted.
    pub waited: u64,
    /// Requests that gave up waiting (their wait would have passed `max_wait`).
    pub wait_timeouts: u64,
    /// Requests waiting now.
    pub waiting: u64,
    /// Requests admitted although they would have been refused: by the layer in shadow
    /// mode ([`LimitLayer::shadow`](crate::LimitLayer::shadow)), or by a limit in shadow
    /// mode ([`LimitPolicy::shadow`](crate::LimitPolicy::shadow)).
    pub shadow_refused: u64,
}

pub(crate) struct Shared<B> {
    pub(crate) backend: B,
    /// The policy an in-memory backend was built from, when there is one.
    pub(crate) source: Option<Source<B>>,
    pub(crate) clock: LayerClock,
    pub(crate) settings: Settings,
    pub(crate) waiters: Waiters,
    pub(crate) refused: AtomicU64,
    pub(crate) waited: AtomicU64,
    pub(crate) wait_timeouts: AtomicU64,
    pub(crate) shadow_refused: AtomicU64,
    pub(crate) key_watch: crate::extract::KeyWatch,
    /// How long concurrency permits are held: the wait a concurrency refusal suggests.
    pub(crate) holds: HoldTimes,
}

impl<B> Shared<B> {
    pub(crate) fn new(backend: B, clock: LayerClock, settings: Settings) -> Self {
        Shared {
            backend,
            source: None,
            clock,
            settings,
            waiters: Waiters::default(),
            refused: AtomicU64::new(0),
            waited: AtomicU64::new(0),
            wait_timeouts: AtomicU64::new(0),
            shadow_refused: AtomicU64::new(0),
            key_watch: crate::extract::KeyWatch::default(),
            holds: HoldTimes::default(),
        }
    }

    /// Counts a refusal, and reports it.
    /// A concurrency refusal of `key`, whose wait nobody knows, suggests its turn by the
    /// recent mean hold time.
    pub(crate) fn count_refusal(&self, error: &mut LimitError, key: Option<&TenantKey>) {
        if error.kind == crate::ErrorKind::ConcurrencyLimited && error.retry_after.is_none() {
            let capacity = error.snapshot.map_or(1, |s| s.quota);
            let now = tower_limits_core::Clock::now(&self.clock).as_nanos();
            error.retry_after = self.holds.turn(key, capacity, self.settings.retry_spacing, now);
        }
        self.refused.fetch_add(1, Ordering::Relaxed);
        self.settings.meter.refused(error);
    }

    pub(crate) fn layer_stats(&self) -> LayerStats {
        LayerStats {
            refused: self.refused.load(Ordering::Relaxed),
            waited: self.waited.load(Ordering::Relaxed),
            wait_timeouts: self.wait_timeouts.load(Ordering::Relaxed),
            waiting: self.waiters.len() as u64,
            shadow_refused: self.shadow_refused.load(Ordering::Relaxed),
        }
    }
}

impl<B> fmt::Debug for Shared<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared").field("settings", &self.settings).finish_non_exhaustive()
    }
}

/// The policy a layer's backend was built from, and how to build it again: a named
/// single-limit layer starts global and becomes per key when it is given a key extractor.
pub(crate) struct Source<B> {
    pub(crate) policy: LimitSetPolicy,
    /// A named layer's one global limit, still to be scoped per key by `key`.
    pub(crate) single: bool,
    build: fn(LimitSetPolicy) -> B,
}

impl<B> Clone for Source<B> {
    fn clone(&self) -> Self {
        Source { policy: self.policy.clone(), single: self.single, build: self.build }
    }
}

/// The tier a named layer's limit is keyed by once it has a key extractor.
pub(crate) const KEY_TIER: &str = "key";

impl Source<LimitSet> {
    pub(crate) fn memory(policy: LimitSetPolicy) -> Self {
        Source { policy, single: false, build: rebuild }
    }

    pub(crate) fn single(policy: LimitSetPolicy) -> Self {
        Source { policy, single: true, build: rebuild }
    }
}

fn rebuild(policy: LimitSetPolicy) -> LimitSet {
    // Only policies that built once, scoped by one more tier, come here.
    LimitSet::new(policy).unwrap_or_else(|e| unreachable!("a valid policy scoped per key is valid: {e}"))
}

impl<B> Source<B> {
    /// The same limits, each kept per key.
    pub(crate) fn keyed(&self) -> Self {
        let mut policy = self.policy.clone();
        policy.tiers = vec![KEY_TIER.to_owned()];
        for limit in &mut policy.limits {
            limit.scope = Scope::Tier(KEY_TIER.to_owned());
        }
        Source { policy, single: false, build: self.build }
    }

    /// A backend enforcing this source's policy.
    pub(crate) fn backend(&self) -> B {
        (self.build)(self.policy.clone())
    }
}
