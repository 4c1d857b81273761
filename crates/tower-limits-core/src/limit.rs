//! A validated limit of any algorithm, and the validated configuration of a set.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::algorithm::{
    Algorithm, FixedWindow, FixedWindowState, Gcra, GcraState, Refusal, Semaphore, SemaphoreState,
    SlidingWindowCounter, SlidingWindowCounterState, SlidingWindowLog, SlidingWindowLogState, Snapshot, TokenBucket,
    TokenBucketState,
};
use crate::key::MAX_TIERS;
use crate::policy::{AlgorithmKind, Counts, LimitPolicy, LimitSetPolicy, MAX_LIMITS, PolicyError, Scope};
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
            (Limit::Semaphore($a), LimitState::Semaphore($s)) => $body,
            _ => $mismatch,
        }
    };
}

impl Limit {
    /// Builds the limit a policy describes.
    ///
    /// # Errors
    /// A missing, unused or invalid parameter, naming the field.
    pub fn from_policy(p: &LimitPolicy) -> Result<Limit, PolicyError> {
        let kind = p.algorithm;
        let unused = |field: &str, present: bool| {
            if present { Err(PolicyError::new(field, format!("is not used by {}", kind.as_str()))) } else { Ok(()) }
        };
        let required = |field: &str| PolicyError::new(field, format!("is required by {}", kind.as_str()));
        match kind {
            AlgorithmKind::Gcra | AlgorithmKind::TokenBucket => {
                unused("limit", p.limit.is_some())?;
                unused("window", p.window.is_some())?;
                unused("capacity", p.capacity.is_some())?;
                let rate = p.rate.ok_or_else(|| required("rate"))?;
                let burst = p.burst.unwrap_or(rate.amount());
                Ok(if kind == AlgorithmKind::Gcra {
                    Limit::Gcra(Gcra::new(rate, burst)?)
                } else {
                    Limit::TokenBucket(TokenBucket::new(rate, burst)?)
                })
            }
            AlgorithmKind::SlidingWindowLog | AlgorithmKind::SlidingWindowCounter | AlgorithmKind::FixedWindow => {
                unused("rate", p.rate.is_some())?;
                unused("burst", p.burst.is_some())?;
                unused("capacity", p.capacity.is_some())?;
                let limit = p.limit.ok_or_else(|| required("limit"))?;
                let window = p.window.ok_or_else(|| required("window"))?;
                Ok(match kind {
                    AlgorithmKind::SlidingWindowLog => Limit::SlidingWindowLog(SlidingWindowLog::new(limit, window)?),
                    AlgorithmKind::SlidingWindowCounter => {
                        Limit::SlidingWindowCounter(SlidingWindowCounter::new(limit, window)?)
                    }
                    _ => Limit::FixedWindow(FixedWindow::new(limit, window)?),
                })
            }
            AlgorithmKind::Semaphore => {
                unused("rate", p.rate.is_some())?;
                unused("burst", p.burst.is_some())?;
                unused("limit", p.limit.is_some())?;
                unused("window", p.window.is_some())?;
                Ok(Limit::Semaphore(Semaphore::new(p.capacity.ok_or_else(|| required("capacity"))?)?))
            }
        }
    }

    /// The algorithm.
    #[must_use]
    pub fn kind(&self) -> AlgorithmKind {
        match self {
            Limit::Gcra(_) => AlgorithmKind::Gcra,
            Limit::TokenBucket(_) => AlgorithmKind::TokenBucket,
            Limit::SlidingWindowLog(_) => AlgorithmKind::SlidingWindowLog,
            Limit::SlidingWindowCounter(_) => AlgorithmKind::SlidingWindowCounter,
            Limit::FixedWindow(_) => AlgorithmKind::FixedWindow,
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

/// One limit of a validated set.
#[derive(Debug, Clone)]
pub(crate) struct LimitDef {
    pub(crate) name: &'static str,
    /// `None` for global, else the tier index: the key is the path of `tier + 1` parts.
    pub(crate) tier: Option<usize>,
    pub(crate) counts: Counts,
    pub(crate) limit: Limit,
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
    /// The deepest tier any limit is keyed by, plus one: how deep a key must be.
    pub(crate) depth_needed: usize,
    /// A fresh state per limit, so that checking a key never seen allocates nothing.
    pub(crate) fresh: Vec<LimitState>,
    /// How many limits are keyed by a tier: the states one key needs.
    pub(crate) keyed_limits: usize,
}

static VERSIONS: AtomicU64 = AtomicU64::new(1);

/// Limit and tier names live as long as the process, so that a denial can name its limit
/// without a reference count on the hot path. Each distinct name is stored once, so the
/// memory this takes is bounded by the vocabulary of names a process ever uses: keep
/// tenants in keys, not in limit names. Backends that build denials themselves use it too.
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
    pub(crate) fn build(policy: &LimitSetPolicy) -> Result<Config, PolicyError> {
        if policy.tiers.len() > MAX_TIERS {
            return Err(PolicyError::new("tiers", format!("at most {MAX_TIERS} tiers, got {}", policy.tiers.len())));
        }
        for (i, tier) in policy.tiers.iter().enumerate() {
            let field = format!("tiers[{i}]");
            if tier.is_empty() {
                return Err(PolicyError::new(field, "a tier needs a name"));
            }
            if tier == "global" {
                return Err(PolicyError::new(field, "\"global\" is reserved for limits shared by every key"));
            }
            if policy.tiers[..i].contains(tier) {
                return Err(PolicyError::new(field, format!("tier {tier:?} is listed twice")));
            }
        }
        if policy.limits.is_empty() {
            return Err(PolicyError::new("limit", "a limit set needs at least one limit"));
        }
        if policy.limits.len() > MAX_LIMITS {
            return Err(PolicyError::new(
                "limit",
                format!("a limit set holds at most {MAX_LIMITS} limits, got {}", policy.limits.len()),
            ));
        }
        if policy.max_keys == 0 {
            return Err(PolicyError::new("max_keys", "must be at least 1"));
        }
        let keyed = policy.limits.iter().filter(|l| l.scope != Scope::Global).count();
        if policy.max_keys < keyed {
            return Err(PolicyError::new(
                "max_keys",
                format!("must be at least {keyed}, the number of keyed limits: one key needs a state in each"),
            ));
        }
        let mut limits = Vec::with_capacity(policy.limits.len());
        for (i, p) in policy.limits.iter().enumerate() {
            let at = if p.name.is_empty() { format!("limits[{i}]") } else { format!("limits[{i}] ({})", p.name) };
            if p.name.is_empty() {
                return Err(PolicyError::new("name", "a limit needs a name").within(&at));
            }
            if let Some(j) = policy.limits[..i].iter().position(|q| q.name == p.name) {
                return Err(
                    PolicyError::new("name", format!("{:?} is already the name of limits[{j}]", p.name)).within(&at)
                );
            }
            let tier = match &p.scope {
                Scope::Global => None,
                Scope::Tier(t) => Some(policy.tiers.iter().position(|x| x == t).ok_or_else(|| {
                    let known = if policy.tiers.is_empty() {
                        "the set declares no tiers".to_owned()
                    } else {
                        format!("tiers are {}", policy.tiers.join(", "))
                    };
                    PolicyError::new("scope", format!("unknown tier {t:?} ({known})")).within(&at)
                })?),
            };
            let limit = Limit::from_policy(p).map_err(|e| e.within(&at))?;
            limits.push(LimitDef { name: intern(&p.name), tier, counts: p.counts, limit });
        }
        Ok(Config {
            version: VERSIONS.fetch_add(1, Ordering::Relaxed),
            tiers: policy.tiers.iter().map(|t| intern(t)).collect(),
            has_global: limits.iter().any(|l| l.tier.is_none()),
            has_tiered: limits.iter().any(|l| l.tier.is_some()),
            has_semaphore: limits.iter().any(|l| l.limit.is_semaphore()),
            depth_needed: limits.iter().filter_map(|l| l.tier).map(|t| t + 1).max().unwrap_or(0),
            max_keys: policy.max_keys,
            fresh: limits.iter().map(|l| l.limit.fresh()).collect(),
            keyed_limits: limits.iter().filter(|l| l.tier.is_some()).count(),
            limits,
        })
    }

    /// The index in `self` of the limit that `other.limits[i]` became: same name, same
    /// algorithm and same scope, or none.
    pub(crate) fn successor(&self, other: &Config, i: usize) -> Option<usize> {
        let old = &other.limits[i];
        self.limits.iter().position(|l| {
            l.name == old.name
                && l.limit.kind() == old.limit.kind()
                && l.tier.map(|t| self.tiers[t]) == old.tier.map(|t| other.tiers[t])
                && l.tier == old.tier
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::rate::Rate;

    fn err(policy: &LimitSetPolicy) -> String {
        Config::build(policy).unwrap_err().to_string()
    }

    #[test]
    fn validation_names_the_field() {
        let base = || LimitSetPolicy::new().tiers(["org", "user"]);
        assert_eq!(
            err(&base().limit(LimitPolicy::gcra("rpm", Rate::per_minute(0), 1))),
            "limits[0] (rpm).rate: the amount must be at least 1"
        );
        assert_eq!(
            err(&base().limit(LimitPolicy::gcra("rpm", Rate::per_minute(10), 0))),
            "limits[0] (rpm).burst: must be at least 1"
        );
        assert_eq!(
            err(&base().limit(LimitPolicy::semaphore("c", 1)).limit(LimitPolicy::semaphore("c", 2))),
            "limits[1] (c).name: \"c\" is already the name of limits[0]"
        );
        assert_eq!(
            err(&base().limit(LimitPolicy::semaphore("c", 1).per("usr"))),
            "limits[0] (c).scope: unknown tier \"usr\" (tiers are org, user)"
        );
        assert_eq!(err(&base()), "limit: a limit set needs at least one limit");
        let mut p = LimitPolicy::semaphore("c", 1);
        p.rate = Some(Rate::per_second(1));
        assert_eq!(err(&base().limit(p)), "limits[0] (c).rate: is not used by semaphore");
        let mut p = LimitPolicy::fixed_window("w", 1, Duration::from_secs(1));
        p.window = None;
        assert_eq!(err(&base().limit(p)), "limits[0] (w).window: is required by fixed_window");
        assert_eq!(
            err(&LimitSetPolicy::new().tiers(["org", "org"]).limit(LimitPolicy::semaphore("c", 1))),
            "tiers[1]: tier \"org\" is listed twice"
        );
    }

    #[test]
    fn burst_defaults_to_the_rate_amount() {
        let mut p = LimitPolicy::gcra("rpm", Rate::per_minute(600), 1);
        p.burst = None;
        match Limit::from_policy(&p).unwrap() {
            Limit::Gcra(g) => assert_eq!(g.burst(), 600),
            other => panic!("{other:?}"),
        }
    }
}
