//! What the unit tests and the loom models of the lock-free path share: a fast state
//! for a quota, and the rate cap every run of grants must keep.

use super::lease::*;
use super::*;
use crate::policy::{LimitPolicy, LimitSetPolicy};
use crate::rate::Quota;

pub(super) fn fast(quota: Quota) -> Fast {
    let config = Config::build(&LimitSetPolicy::new().limit(LimitPolicy::gcra("r", quota))).unwrap();
    Fast::for_config(&config).unwrap()
}

impl Fast {
    /// As if this thread had seen a swap fail: its next grants take leases.
    pub(in crate::set) fn mark_contended(&self) {
        self.contended.store(true, Ordering::Relaxed);
        let epoch = self.epoch.load(Ordering::Acquire);
        LEASES.with(|l| {
            l[self.slot()].set(Lease { owner: self.id, epoch, contended: true, ..NO_LEASE });
        });
    }

    /// The shared theoretical arrival time.
    pub(super) fn tat(&self) -> u64 {
        self.tat.0.load(Ordering::Acquire)
    }
}

pub(super) fn granted(d: Option<Decision>) -> Option<u64> {
    match d.expect("enabled") {
        Decision::Granted(at, _) => Some(at.as_nanos()),
        Decision::Refused(..) | Decision::Never(_) => None,
    }
}

/// For all `i <= j` of the sorted grants: `(j - i + 1) * interval <= t_j - t_i + tolerance`.
pub(super) fn assert_rate_cap(mut grants: Vec<u64>, interval: u64, tolerance: u64) {
    grants.sort_unstable();
    let mut worst = i128::MIN;
    for (j, &t) in grants.iter().enumerate() {
        let j = j as i128;
        worst = worst.max(i128::from(t) - j * i128::from(interval));
        assert!(worst <= i128::from(t) - (j + 1) * i128::from(interval) + i128::from(tolerance), "over-admission");
    }
}
