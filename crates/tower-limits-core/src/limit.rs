//! A validated limit of any algorithm, and the validated configuration of a set.

use std::collections::BTreeSet;
use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, PoisonError};

use crate::algorithm::{
    Algorithm, CalendarWindow, CalendarWindowState, FixedWindow, FixedWindowState, Gcra, GcraState, Refusal, Semaphore,
    SemaphoreState, SlidingWindowCounter, SlidingWindowCounterState, SlidingWindowLog, SlidingWindowLogState, Snapshot,
    TokenBucket, TokenBucketState,
};
use serde::{Deserialize, Serialize};

use crate::time::Instant;

/// A validated limit of any algorithm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Limit {
    /// See [`Gcra`].
    Gcra(Gcra),
    /// See [`TokenBucket`].
    TokenBucket(TokenBucket),
    /// See [`SlidingWindowLog`].
    SlidingWindowLog(SlidingWindowLog),
    /// See [`SlidingWindowCounter`].
    SlidingWindowCounter(SlidingWindowCounter),
    /// See [`FixedWindow`].
    FixedWindow(FixedWindow),
    /// See [`CalendarWindow`].
    CalendarWindow(CalendarWindow),
    /// See [`Semaphore`].
    Semaphore(Semaphore),
}

/// The state of one key under a [`Limit`]; its variant always matches the limit's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitState {
    /// See [`GcraState`].
    Gcra(GcraState),
    /// See [`TokenBucketState`].
    TokenBucket(TokenBucketState),
    /// See [`SlidingWindowLogState`]; boxed so that the other states stay small.
    SlidingWindowLog(Box<SlidingWindowLogState>),
    /// See [`SlidingWindowCounterState`].
    SlidingWindowCounter(SlidingWindowCounterState),
    /// See [`FixedWindowState`].
    FixedWindow(FixedWindowState),
    /// See [`CalendarWindowState`].
    CalendarWindow(CalendarWindowState),
    /// See [`SemaphoreState`].
    Semaphore(SemaphoreState),
}

/// Runs `$body` with `$a` bound to the algorithm and `$s` to its state. A mismatched
/// pair cannot be built through this crate's API; it is treated as `$mismatch`.
macro_rules! dispatch {
    ($limit:expr, $state:expr, |$a:ident, $s:ident| $body:expr, $mismatch:expr) => {
        match ($limit, $state) {
            (Limit::Gcra($a), LimitState::Gcra($s)) => $body,
            (Limit::TokenBucket($a), LimitState::TokenBucket($s)) => $body,
            (Limit::SlidingWindowLog($a), LimitState::SlidingWindowLog($s)) => $body,
            (Limit::SlidingWindowCounter($a), LimitState::SlidingWindowCounter($s)) => $body,
            (Limit::FixedWindow($a), LimitState::FixedWindow($s)) => $body,
            (Limit::CalendarWindow($a), LimitState::CalendarWindow($s)) => $body,
            (Limit::Semaphore($a), LimitState::Semaphore($s)) => $body,
            _ => $mismatch,
        }
    };
}

impl Limit {
    /// The algorithm.
    #[must_use]
    pub fn kind(&self) -> AlgorithmKind {
        match self {
            Limit::Gcra(_) => AlgorithmKind::Gcra,
            Limit::TokenBucket(_) => AlgorithmKind::TokenBucket,
            Limit::SlidingWindowLog(_) => AlgorithmKind::SlidingWindowLog,
            Limit::SlidingWindowCounter(_) => AlgorithmKind::SlidingWindowCounter,
            Limit::FixedWindow(_) => AlgorithmKind::FixedWindow,
            Limit::CalendarWindow(_) => AlgorithmKind::CalendarWindow,
            Limit::Semaphore(_) => AlgorithmKind::Semaphore,
        }
    }

    /// Whether this limit holds concurrency until released.
    #[must_use]
    pub fn is_semaphore(&self) -> bool {
        matches!(self, Limit::Semaphore(_))
    }

    /// The state of a key never used.
    #[must_use]
    pub fn fresh(&self) -> LimitState {
        match self {
            Limit::Gcra(a) => LimitState::Gcra(a.fresh()),
            Limit::TokenBucket(a) => LimitState::TokenBucket(a.fresh()),
            Limit::SlidingWindowLog(a) => LimitState::SlidingWindowLog(Box::new(a.fresh())),
            Limit::SlidingWindowCounter(a) => LimitState::SlidingWindowCounter(a.fresh()),
            Limit::FixedWindow(a) => LimitState::FixedWindow(a.fresh()),
            Limit::CalendarWindow(a) => LimitState::CalendarWindow(a.fresh()),
            Limit::Semaphore(a) => LimitState::Semaphore(a.fresh()),
        }
    }

    /// The most this limit can grant at once.
    #[must_use]
    pub fn capacity(&self) -> u64 {
        match self {
            Limit::Gcra(a) => a.capacity(),
            Limit::TokenBucket(a) => a.capacity(),
            Limit::SlidingWindowLog(a) => a.capacity(),
            Limit::SlidingWindowCounter(a) => a.capacity(),
            Limit::FixedWindow(a) => a.capacity(),
            Limit::CalendarWindow(a) => a.capacity(),
            Limit::Semaphore(a) => a.capacity(),
        }
    }

    /// See [`Algorithm::check`].
    ///
    /// # Errors
    /// The refusal.
    #[inline]
    pub fn check(&self, state: &LimitState, now: Instant, cost: u64) -> Result<(), Refusal> {
        dispatch!(self, state, |a, s| a.check(s, now, cost), Err(Refusal::Never { capacity: 0 }))
    }

    /// See [`Algorithm::commit`].
    #[inline]
    pub fn commit(&self, state: &mut LimitState, now: Instant, cost: u64) {
        dispatch!(self, state, |a, s| a.commit(s, now, cost), ())
    }

    /// See [`Algorithm::acquire`].
    ///
    /// # Errors
    /// The refusal.
    #[inline]
    pub fn acquire(&self, state: &mut LimitState, now: Instant, cost: u64) -> Result<(), Refusal> {
        dispatch!(self, state, |a, s| a.acquire(s, now, cost), Err(Refusal::Never { capacity: 0 }))
    }

    /// See [`Algorithm::refund`].
    pub fn refund(&self, state: &mut LimitState, now: Instant, granted_at: Instant, amount: u64) {
        dispatch!(self, state, |a, s| a.refund(s, now, granted_at, amount), ())
    }

    /// See [`Algorithm::charge`].
    pub fn charge(&self, state: &mut LimitState, now: Instant, granted_at: Instant, amount: u64) {
        dispatch!(self, state, |a, s| a.charge(s, now, granted_at, amount), ())
    }

    /// See [`Algorithm::release`].
    pub fn release(&self, state: &mut LimitState, amount: u64) {
        dispatch!(self, state, |a, s| a.release(s, amount), ())
    }

    /// See [`Algorithm::peek`].
    #[must_use]
    pub fn peek(&self, state: &LimitState, now: Instant) -> Snapshot {
        dispatch!(
            self,
            state,
            |a, s| a.peek(s, now),
            Snapshot {
                quota: self.capacity(),
                remaining: self.capacity(),
                reset: std::time::Duration::ZERO,
                window: std::time::Duration::ZERO,
            }
        )
    }

    /// See [`Algorithm::is_idle`].
    #[must_use]
    pub fn is_idle(&self, state: &LimitState, now: Instant) -> bool {
        dispatch!(self, state, |a, s| a.is_idle(s, now), true)
    }
}

/// The algorithm of a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AlgorithmKind {
    /// [`Gcra`](crate::algorithm::Gcra): `rate` and `burst`.
    Gcra,
    /// [`TokenBucket`](crate::algorithm::TokenBucket): `rate` and `burst`.
    TokenBucket,
    /// [`SlidingWindowLog`](crate::algorithm::SlidingWindowLog): `limit` and `window`.
    SlidingWindowLog,
    /// [`SlidingWindowCounter`](crate::algorithm::SlidingWindowCounter): `limit` and `window`.
    SlidingWindowCounter,
    /// [`FixedWindow`](crate::algorithm::FixedWindow): `limit` and `window`.
    FixedWindow,
    /// [`CalendarWindow`](crate::algorithm::CalendarWindow): `limit`, `period` and
    /// `timezone`.
    CalendarWindow,
    /// [`Semaphore`](crate::algorithm::Semaphore): `capacity`.
    Semaphore,
}

impl AlgorithmKind {
    /// The name used in policy files.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            AlgorithmKind::Gcra => "gcra",
            AlgorithmKind::TokenBucket => "token_bucket",
            AlgorithmKind::SlidingWindowLog => "sliding_window_log",
            AlgorithmKind::SlidingWindowCounter => "sliding_window_counter",
            AlgorithmKind::FixedWindow => "fixed_window",
            AlgorithmKind::CalendarWindow => "calendar_window",
            AlgorithmKind::Semaphore => "semaphore",
        }
    }
}

/// Whose capacity a limit counts: everyone's, or each key's at one tier.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum Scope {
    /// One state shared by every request.
    #[default]
    Global,
    /// One state per key at the named tier (and the tiers above it).
    Tier(String),
}

impl Serialize for Scope {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Scope::Global => s.serialize_str("global"),
            Scope::Tier(t) => s.serialize_str(t),
        }
    }
}

impl<'de> Deserialize<'de> for Scope {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Ok(if s == "global" { Scope::Global } else { Scope::Tier(s) })
    }
}

/// What one request costs against a limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Counts {
    /// One per request, whatever the request's cost: requests per minute, concurrent
    /// requests.
    #[default]
    Requests,
    /// The request's cost (for example its estimated tokens), settled to the real usage
    /// afterwards: tokens per minute.
    Cost,
}

/// The most limits one set can hold.
pub const MAX_LIMITS: usize = 16;

/// One limit of a validated set.
#[derive(Debug, Clone)]
pub(crate) struct LimitDef {
    pub(crate) name: &'static str,
    /// `None` for global, else the tier index: the key is the path of `tier + 1` parts.
    pub(crate) tier: Option<usize>,
    pub(crate) counts: Counts,
    pub(crate) limit: Limit,
    /// Decides and counts, never refuses (see [`LimitPolicy::shadow`](crate::LimitPolicy::shadow)).
    pub(crate) shadow: bool,
}

/// A validated set policy, shared by every shard of a set.
#[derive(Debug)]
pub(crate) struct Config {
    pub(crate) version: u64,
    pub(crate) tiers: Vec<&'static str>,
    pub(crate) limits: Vec<LimitDef>,
    pub(crate) max_keys: usize,
    pub(crate) has_global: bool,
    pub(crate) has_tiered: bool,
    pub(crate) has_semaphore: bool,
    /// The deepest tier any enforcing limit is keyed by, plus one: how deep a key must be.
    pub(crate) depth_needed: usize,
    /// A fresh state per limit, so that checking a key never seen allocates nothing.
    pub(crate) fresh: Vec<LimitState>,
    /// How many limits are keyed by a tier: the states one key needs.
    pub(crate) keyed_limits: usize,
    /// The tier of the set's one limit, when that limit is keyed and enforcing: the
    /// commonest keyed set (one rate per client), decided under the shard's lock alone
    /// with one hash of the key.
    pub(crate) one_keyed: Option<usize>,
    /// The tiers the limits are keyed by, each once, from the broadest.
    pub(crate) tiers_used: Vec<usize>,
    /// The keyed semaphores, as (limit, tier): what a release gives back under the key's
    /// shard lock alone, when no semaphore is global.
    pub(crate) keyed_semaphores: Vec<(usize, usize)>,
    /// Whether some semaphore is global (a release then takes the global lock too).
    pub(crate) global_semaphore: bool,
    /// What grants keep of it.
    pub(crate) shape: &'static Shape,
}

pub(crate) static VERSIONS: AtomicU64 = AtomicU64::new(1);

/// What a grant needs of the policy it was made under, to release its semaphores (also
/// after a replace) and to name the shadow limits that would have refused it. It lives as
/// long as the process, interned by content like the names in it: a grant refers to it
/// with no reference count, so grants on many cores write no shared line for it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    pub(crate) tiers: Vec<&'static str>,
    pub(crate) limits: Vec<LimitShape>,
    pub(crate) has_semaphore: bool,
}

/// One limit of a [`Shape`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct LimitShape {
    pub(crate) name: &'static str,
    pub(crate) tier: Option<usize>,
    pub(crate) kind: AlgorithmKind,
    pub(crate) counts: Counts,
}

impl Shape {
    /// The shape of a policy's limits, stored once per distinct shape: the memory it
    /// takes is bounded by the policies a process ever builds, not by how often.
    pub(crate) fn interned(tiers: &[&'static str], limits: &[LimitDef]) -> &'static Shape {
        // Few distinct shapes, looked up only when a set is built or replaced.
        static SHAPES: Mutex<Vec<&'static Shape>> = Mutex::new(Vec::new());
        let shape = Shape {
            tiers: tiers.to_vec(),
            limits: limits
                .iter()
                .map(|l| LimitShape { name: l.name, tier: l.tier, kind: l.limit.kind(), counts: l.counts })
                .collect(),
            has_semaphore: limits.iter().any(|l| l.limit.is_semaphore()),
        };
        let mut shapes = SHAPES.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(known) = shapes.iter().find(|known| ***known == shape) {
            return known;
        }
        let leaked: &'static Shape = Box::leak(Box::new(shape));
        shapes.push(leaked);
        leaked
    }
}

/// Limit and tier names live as long as the process, so that a refusal can name its limit
/// without a reference count on the hot path. Each distinct name is stored once, so the
/// memory this takes is bounded by the vocabulary of names a process ever uses: keep
/// tenants in keys, not in limit names. Backends that build refusals themselves use it too.
#[must_use]
pub fn intern(name: &str) -> &'static str {
    static NAMES: Mutex<BTreeSet<&'static str>> = Mutex::new(BTreeSet::new());
    let mut names = NAMES.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(known) = names.get(name) {
        return known;
    }
    let leaked: &'static str = Box::leak(name.to_owned().into_boxed_str());
    names.insert(leaked);
    leaked
}

impl Config {
    /// The index in `self` of the limit that `other.limits[i]` became: same name, same
    /// algorithm and same scope, or none.
    pub(crate) fn successor(&self, other: &Shape, i: usize) -> Option<usize> {
        let old = &other.limits[i];
        self.limits.iter().position(|l| {
            l.name == old.name
                && l.limit.kind() == old.kind
                && l.tier.map(|t| self.tiers[t]) == old.tier.map(|t| other.tiers[t])
                && l.tier == old.tier
        })
    }
}
