//! What a lease refresh reports of the replica, and what it said of the replica's demand,
//! from which the next refresh is due early when the demand moved.

use super::{DEAD, LARGE, WHOLE};

/// What a lease refresh tells Redis: see [`Leases::report`](super::Leases::report).
pub(in crate::accounts) struct Report {
    /// The rate and burst fractions the replica may still be using.
    pub(in crate::accounts) using: (u64, u64),
    /// The most rate it could use.
    pub(in crate::accounts) cap: u64,
    /// The least burst part that holds the largest request it was asked lately.
    pub(in crate::accounts) least: u64,
    /// What the report stands for: admitted, refused, the largest cost.
    pub(in crate::accounts) counts: (u64, u64, u64),
}

/// What a report said of the replica's demand, to tell whether it moved since: a lease
/// refresh is due early when it did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::accounts) struct Sent {
    /// The bands some tenant waits in (bit `b` for band `b`), and whether any tenant has
    /// requests waiting or in flight.
    pub(super) bands: u64,
    pub(super) active: bool,
    /// Could use everything (refusing, or with requests waiting) and held less.
    pub(super) short: bool,
    /// The least burst part it needs, and whether the burst part it held was smaller.
    pub(super) least: u64,
    pub(super) cramped: bool,
}

impl Sent {
    /// The demand in `reported` and `report`.
    pub(in crate::accounts) fn of(reported: &[tower_limits_core::fleet::TenantDemand], report: &Report) -> Sent {
        Sent {
            bands: reported.iter().fold(0, |bands, d| bands | d.bands),
            active: reported.iter().any(|d| d.outstanding > 0),
            // (Short: it could use everything, refusing or with requests waiting, and
            // holds less. A replica below its part wants twice what it admitted, which
            // swings around what it holds from one period to the next.)
            short: report.cap >= WHOLE && report.using.0.saturating_add(DEAD) < WHOLE,
            least: report.least,
            cramped: report.least > report.using.1,
        }
    }

    /// Whether the demand moved from `self` to `now`, for a replica holding `held` of the
    /// rate and wanting at most `cap`: a band started or stopped waiting, the replica
    /// turned idle or busy, short of its part or no longer short, its requests outgrew its
    /// burst part, or it holds a tenth of the whole more than it could use. (Tenants
    /// coming and going within a band, and the counts of requests waiting, swing from one
    /// instant to the next: they count at the next period.)
    pub(super) fn moved(&self, now: &Sent, held: u64, cap: u64) -> bool {
        self.bands != now.bands
            || self.active != now.active
            || self.short != now.short
            || (now.cramped && now.least > self.least)
            || cap + LARGE < held
    }
}
