//! Warnings that would repeat for every operation while Redis is away: said at most once
//! every few seconds, each with how many it stands for.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The least time between two warnings of one kind.
pub(crate) const WARN_EVERY: Duration = Duration::from_secs(5);

/// When a kind of warning was last said, and how many were left out since.
#[derive(Debug, Default)]
pub(crate) struct Throttle {
    state: Mutex<(Option<Instant>, u64)>,
}

impl Throttle {
    pub(crate) const fn new() -> Self {
        Throttle { state: Mutex::new((None, 0)) }
    }

    /// Whether to warn now: the number of warnings left out since the last one said, or
    /// `None` (counted as left out) within [`WARN_EVERY`] of it.
    pub(crate) fn warn_now(&self) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let (last, left_out) = &mut *state;
        if last.is_some_and(|at| at.elapsed() < WARN_EVERY) {
            *left_out += 1;
            return None;
        }
        *last = Some(Instant::now());
        Some(std::mem::take(left_out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_warning_stands_for_those_left_out_after_it() {
        let throttle = Throttle::new();
        assert_eq!(throttle.warn_now(), Some(0));
        assert_eq!(throttle.warn_now(), None);
        assert_eq!(throttle.warn_now(), None);
        // As if the last warning were said long ago: the next one counts the two left out.
        throttle.state.lock().unwrap().0 = Instant::now().checked_sub(WARN_EVERY);
        assert_eq!(throttle.warn_now(), Some(2));
        assert_eq!(throttle.warn_now(), None);
    }
}
