//! Learning an upstream account's real quota from its answers, sans IO.
//!
//! An account's quota as configured is often not the one its provider enforces: tiers
//! change, providers adjust limits, a shared key is used elsewhere. A [`LimitPool`]'s
//! mirror of an account should follow the real one. A [`QuotaLearner`] keeps one quota
//! (requests or tokens per window) of one account: the operator declares it, and each
//! answer of the upstream moves it.
//!
//! # The rule
//!
//! - **Stated limits lower at once.** An answer stating the account's limit
//!   (`x-ratelimit-limit-*`) below the learned quota sets it there: the calls already
//!   admitted at the old pace are the only ones that can meet a refusal.
//! - **A refusal lowers** (a `429`): by `lower_percent` of the learned quota (10% by
//!   default), whether or not the answer stated a limit, and no raise follows for one
//!   window.
//! - **Raises are slow and bounded.** When the target (the last stated limit, or the
//!   declared quota when none was stated) is above the learned quota, the quota rises by
//!   `raise_percent` of itself (25% by default) at most once per window, never above the
//!   target, and never above the ceiling the operator sets (`ceiling_percent` of the
//!   declared quota, 100% by default: learning then only lowers, and recovers up to what
//!   was declared).
//!
//! # Bounds
//!
//! The learned quota is always between 1 and the ceiling. After an upstream starts
//! stating a limit `L` below it, the next answer sets it to `L`: the refusals that follow
//! are those of the calls admitted before that answer came back. After the upstream
//! raises its limit to `L' ≤ ceiling`, the learned quota `q` reaches `L'` within
//! `⌈log(L'/q) / log(1 + raise_percent/100)⌉` windows (four windows from half to the
//! whole at 25%, seven from half to double). Unlike latency-driven limiters, nothing here rises without the
//! upstream saying so (or without the declared quota allowing it), so a long overload
//! cannot drift the quota upwards.
//!
//! ```
//! use std::time::Duration;
//! use tower_limits_core::learn::{LearnSettings, QuotaLearner};
//! use tower_limits_core::Instant;
//!
//! let second = Duration::from_secs(1);
//! let mut tokens = QuotaLearner::new(10_000, second, LearnSettings::new().ceiling_percent(200));
//! // The upstream says its real limit is half the declared one: learned at once.
//! assert_eq!(tokens.observe(Some(5_000), false, Instant::ZERO), Some(5_000));
//! // Then it doubles: the quota rises a quarter a window, to the limit stated.
//! let mut at = Instant::ZERO;
//! while tokens.learned() < 20_000 {
//!     at = at + second;
//!     tokens.observe(Some(20_000), false, at);
//! }
//! assert_eq!(at, Instant::ZERO + 7 * second);
//! ```
//!
//! [`LimitPool`]: crate::LimitPool

use std::time::Duration;

use crate::Instant;

/// How a [`QuotaLearner`] moves: its ceiling, how fast it rises and how far a refusal
/// lowers it.
///
/// ```
/// use tower_limits_core::learn::LearnSettings;
///
/// let settings = LearnSettings::new().ceiling_percent(150).raise_percent(10).lower_percent(20);
/// assert_eq!(settings, LearnSettings { ceiling_percent: 150, raise_percent: 10, lower_percent: 20 });
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LearnSettings {
    /// The most the learned quota may reach, in percent of the declared one (at least
    /// 100; 100 by default).
    pub ceiling_percent: u32,
    /// How much the quota may rise per window, in percent of itself (at least 1; 25 by
    /// default).
    pub raise_percent: u32,
    /// How much a refusal lowers it, in percent of itself (at most 90; 10 by default).
    pub lower_percent: u32,
}

impl Default for LearnSettings {
    fn default() -> Self {
        Self::new()
    }
}

impl LearnSettings {
    /// A ceiling at the declared quota, raises of 25% a window, refusals lowering 10%.
    #[must_use]
    pub const fn new() -> Self {
        LearnSettings { ceiling_percent: 100, raise_percent: 25, lower_percent: 10 }
    }

    /// With the ceiling at `percent` of the declared quota (below 100 counts as 100).
    #[must_use]
    pub const fn ceiling_percent(mut self, percent: u32) -> Self {
        self.ceiling_percent = percent;
        self
    }

    /// With raises of `percent` of the quota a window (0 counts as 1).
    #[must_use]
    pub const fn raise_percent(mut self, percent: u32) -> Self {
        self.raise_percent = percent;
        self
    }

    /// With refusals lowering the quota by `percent` of it (above 90 counts as 90).
    #[must_use]
    pub const fn lower_percent(mut self, percent: u32) -> Self {
        self.lower_percent = percent;
        self
    }
}

/// One quota of one account (requests or tokens per window), learned from the upstream's
/// answers; see the [module docs](self) for the rule and its bounds.
#[derive(Debug, Clone)]
pub struct QuotaLearner {
    declared: u64,
    ceiling: u64,
    learned: u64,
    window: Duration,
    raise_percent: u64,
    lower_percent: u64,
    /// The limit the upstream last stated.
    stated: Option<u64>,
    /// No raise before this instant.
    next_raise: Instant,
}

impl QuotaLearner {
    /// A quota declared at `declared` per `window` (0 counts as 1), learned from there.
    #[must_use]
    pub fn new(declared: u64, window: Duration, settings: LearnSettings) -> Self {
        let declared = declared.max(1);
        let ceiling = (u128::from(declared) * u128::from(settings.ceiling_percent.max(100)) / 100) as u64;
        QuotaLearner {
            declared,
            ceiling: ceiling.max(declared),
            learned: declared,
            window,
            raise_percent: u64::from(settings.raise_percent.max(1)),
            lower_percent: u64::from(settings.lower_percent.min(90)),
            stated: None,
            next_raise: Instant::ZERO,
        }
    }

    /// One answer of the upstream at `now`: the limit it stated (if any) and whether it
    /// refused. Returns the learned quota when it changed.
    pub fn observe(&mut self, stated: Option<u64>, refused: bool, now: Instant) -> Option<u64> {
        let before = self.learned;
        if let Some(limit) = stated {
            self.stated = Some(limit);
        }
        if refused {
            let cut = (u128::from(self.learned) * u128::from(self.lower_percent)).div_ceil(100) as u64;
            self.learned = self.learned.saturating_sub(cut.max(1)).max(1);
            self.next_raise = now + self.window;
        }
        let target = self.stated.unwrap_or(self.declared).clamp(1, self.ceiling);
        if target < self.learned {
            self.learned = target;
            self.next_raise = now + self.window;
        } else if target > self.learned && now >= self.next_raise {
            let step = (u128::from(self.learned) * u128::from(self.raise_percent)).div_ceil(100) as u64;
            self.learned = self.learned.saturating_add(step.max(1)).min(target);
            self.next_raise = now + self.window;
        }
        (self.learned != before).then_some(self.learned)
    }

    /// The quota learned so far.
    #[must_use]
    pub fn learned(&self) -> u64 {
        self.learned
    }

    /// The quota declared.
    #[must_use]
    pub fn declared(&self) -> u64 {
        self.declared
    }

    /// The most it may learn.
    #[must_use]
    pub fn ceiling(&self) -> u64 {
        self.ceiling
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = Duration::from_secs(1);

    fn at(windows: u64) -> Instant {
        Instant::ZERO + W * u32::try_from(windows).unwrap()
    }

    #[test]
    fn a_stated_limit_below_lowers_at_once_and_a_raise_waits_a_window() {
        let mut q = QuotaLearner::new(1_000, W, LearnSettings::new().ceiling_percent(200));
        assert_eq!(q.observe(Some(1_000), false, at(0)), None);
        assert_eq!(q.observe(Some(400), false, at(0)), Some(400));
        // Stated higher again: one step a window, a quarter of the quota each.
        assert_eq!(q.observe(Some(2_500), false, at(0)), None, "not within the window of the cut");
        assert_eq!(q.observe(Some(2_500), false, at(1)), Some(500));
        assert_eq!(q.observe(Some(2_500), false, at(1)), None, "once a window");
        assert_eq!(q.observe(Some(2_500), false, at(2)), Some(625));
        // Never above the ceiling, whatever is stated.
        let mut n = 2;
        while q.observe(Some(2_500), false, at(n)).is_some() || n < 10 {
            n += 1;
        }
        assert_eq!(q.learned(), 2_000);
        assert_eq!(q.ceiling(), 2_000);
    }

    #[test]
    fn refusals_lower_and_without_a_stated_limit_the_quota_recovers_to_the_declared_one() {
        let mut q = QuotaLearner::new(1_000, W, LearnSettings::new());
        assert_eq!(q.observe(None, true, at(0)), Some(900));
        assert_eq!(q.observe(None, true, at(0)), Some(810));
        assert_eq!(q.observe(None, false, at(0)), None, "no raise within a window of a refusal");
        assert_eq!(q.observe(None, false, at(1)), Some(1_000), "back to the declared quota, not above");
        assert_eq!(q.observe(None, false, at(5)), None);
        // A refusal never takes it below one.
        let mut tiny = QuotaLearner::new(1, W, LearnSettings::new().lower_percent(100));
        assert_eq!(tiny.observe(None, true, at(0)), None);
        assert_eq!(tiny.learned(), 1);
    }

    #[test]
    fn an_answer_stating_the_learned_quota_does_not_hold_back_a_raise() {
        let mut q = QuotaLearner::new(1_000, W, LearnSettings::new().ceiling_percent(200));
        assert_eq!((q.declared(), q.ceiling()), (1_000, 2_000));
        // The upstream states exactly what is learned: nothing moves, not even the time
        // of the next raise, so a higher limit stated at once is followed at once.
        assert_eq!(q.observe(Some(1_000), false, at(3)), None);
        assert_eq!(q.observe(Some(2_000), false, at(3)), Some(1_250));
    }

    #[test]
    fn settings_out_of_range_are_brought_in_range() {
        let q = QuotaLearner::new(0, W, LearnSettings::new().ceiling_percent(50).raise_percent(0));
        assert_eq!((q.declared(), q.ceiling(), q.learned()), (1, 1, 1));
    }
}
