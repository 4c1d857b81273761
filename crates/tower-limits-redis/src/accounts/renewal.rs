//! What leases ask of Redis: the refresh, one call for every member, and the task that
//! renews a busy replica's lease every period. The scheme is in [`super::lease`].

use std::sync::PoisonError;
use std::sync::atomic::Ordering;
use std::time::Duration;

use redis::Value;
use tower_limits_core::Instant;

use super::{Inner, RedisAccounts, demand_args, lease};
use crate::backend::SharesGroup;
use crate::failure::Gate;

/// When a lease refresh is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ask {
    /// Now.
    Now,
    /// Unless a lease came in force while this one waited for its turn (requests without
    /// a lease wait for one call, not one each).
    UnlessHeld,
    /// When the period Redis gave is over, or the replica's demand moved since its last
    /// report (the background task).
    WhenDue,
}

impl Inner {
    /// Renews this replica's lease at `now`, in one call; with `heard` false the answer is
    /// dropped as if lost on its way back (tests). Whether Redis answered.
    pub(super) async fn refresh_lease(&self, now: Instant, heard: bool) -> bool {
        self.refresh_lease_if(now, heard, Ask::Now).await
    }

    /// As [`refresh_lease`](Self::refresh_lease), or nothing sent when `ask` says so.
    pub(super) async fn refresh_lease_if(&self, now: Instant, heard: bool, ask: Ask) -> bool {
        let Some(leases) = &self.leases else { return false };
        let _one_at_a_time = leases.refreshing.lock().await;
        if ask == Ask::UnlessHeld && leases.in_force(now) {
            return true;
        }
        if self.manual_clock {
            self.last_now_us.fetch_max(now.as_nanos() / 1000, Ordering::Relaxed);
        }
        let reported = self.fleet.as_ref().map(|f| f.demand()).unwrap_or_default();
        let report = leases.report(now, reported.iter().any(|d| d.waiting > 0));
        let said = lease::Sent::of(&reported, &report);
        if ask == Ask::WhenDue && !leases.due(now, &said, &report) {
            return true;
        }
        let lease::Report { using: (rate, burst), cap, least, counts } = report;
        // From here the report is sent: the parts it confirms smaller come in force.
        let returned = leases.shrink(now);
        let mut args = vec!["l".to_owned(), self.id.clone(), rate.to_string(), burst.to_string(), cap.to_string()];
        args.extend([least.to_string(), returned.to_string()]);
        let min_shares = self.fleet.as_ref().map(|f| f.min_shares()).unwrap_or_default();
        args.push(min_shares.len().to_string());
        args.extend(min_shares.iter().map(u32::to_string));
        demand_args(&reported, &mut args);
        self.stats.lease_refreshes.fetch_add(1, Ordering::Relaxed);
        // The share group's refresh rides along when it is due (the test's, on a manual
        // clock, every time).
        let ride = self.carried.as_ref().and_then(|group| group.ride(self.manual_clock.then_some(now)));
        let sent = tokio::time::Instant::now();
        let reply = match self.call_carrying(&args, ride.as_ref()).await {
            Ok(reply) => reply,
            Err(_) => {
                if let Some(ride) = ride {
                    SharesGroup::landed(ride, None);
                }
                if let Some(fleet) = &self.fleet {
                    fleet.clear_shares();
                }
                leases.failed(now);
                return false;
            }
        };
        let took = sent.elapsed();
        let ints: Option<Vec<i64>> = match &reply {
            Value::Array(items) => items.iter().map(|v| if let Value::Int(i) = v { Some(*i) } else { None }).collect(),
            _ => None,
        };
        // Carrying: the number of the lease's answers, they, then the shares' (after their
        // time).
        let ints = match (ride, ints) {
            (None, ints) => ints,
            (Some(ride), Some(all)) => {
                let n = all.first().and_then(|&n| usize::try_from(n).ok()).filter(|&n| n < all.len());
                let (lease, shares) = n.map_or((&all[..0], &all[..0]), |n| all[1..].split_at(n));
                SharesGroup::landed(ride, shares.get(1..).filter(|_| heard));
                Some(lease.to_vec())
            }
            (Some(ride), None) => {
                SharesGroup::landed(ride, None);
                None
            }
        };
        let limits: usize =
            self.members.iter().map(|m| m.shape.lock().unwrap_or_else(PoisonError::into_inner).len()).sum();
        let expected = 3 + self.members.len() + reported.len() + min_shares.len() + 2 * limits + 2;
        let Some(ints) = ints.filter(|v: &Vec<i64>| v.len() == expected) else {
            tracing::warn!(target: "tower_limits_redis", reply = ?reply, "unexpected reply to a lease refresh");
            return false;
        };
        leases.reported(counts, now);
        let at = 3 + self.members.len() + reported.len();
        let (bands, rest) = ints[at..].split_at(min_shares.len());
        let (current, times) = rest.split_at(2 * limits);
        self.heard(&ints[3..3 + self.members.len() + reported.len()], reported, now);
        if let Some(fleet) = self.fleet.as_ref().filter(|_| !bands.is_empty()) {
            fleet.set_band_shares(Some(bands.iter().map(|&b| u32::try_from(b).unwrap_or(0)).collect()));
        }
        let current: Vec<(u64, u64)> = current
            .chunks_exact(2)
            .map(|pair| (u64::try_from(pair[0]).unwrap_or(0), u64::try_from(pair[1]).unwrap_or(0)))
            .collect();
        leases.take_limits(&current, now);
        // Short of its allotment while another gives its excess back: ask again just
        // after that one's refresh (2 ms after, so that it comes first).
        let nanos = |i: usize| times.get(i).map_or(0, |&ns| u64::try_from(ns).unwrap_or(0));
        let soon = nanos(0);
        // The period until the next refresh: longer while the fleet is settled.
        let early = (soon > 0 && heard).then(|| Duration::from_nanos(soon) + Duration::from_millis(2));
        leases.heard(now, said, heard.then(|| Duration::from_nanos(nanos(1))), early);
        leases.ask_again(early);
        if heard {
            let fraction = |i: i64| u64::try_from(i).unwrap_or(0).min(lease::WHOLE);
            let parts = (fraction(ints[0]), fraction(ints[1]), fraction(ints[2]));
            leases.granted(parts, now + leases.settings.lasts(), now + took, now);
        }
        true
    }
}

impl RedisAccounts {
    /// Renews this replica's lease now ([`RedisAccountsBuilder::leases`](super::RedisAccountsBuilder::leases)), as the
    /// background task does every refresh period: for tests on a manual clock, where no
    /// background task runs and the test chooses when refreshes happen. Whether Redis answered; `false` without leases.
    ///
    /// # Cancel safety
    /// Dropping the future drops the answer: the replica keeps its lease, and Redis
    /// counts the larger of the two until the next refresh.
    pub async fn refresh_leases(&self, now: Instant) -> bool {
        if let Some(leases) = &self.inner.leases {
            leases.latest.fetch_max(now.as_nanos(), Ordering::Relaxed);
        }
        self.inner.refresh_lease(now, true).await
    }

    /// As [`refresh_leases`](Self::refresh_leases), but the answer is lost on its way
    /// back: Redis applied it, the replica never learns it (tests).
    #[cfg(feature = "test-support")]
    pub async fn refresh_leases_unheard(&self, now: Instant) -> bool {
        if let Some(leases) = &self.inner.leases {
            leases.latest.fetch_max(now.as_nanos(), Ordering::Relaxed);
        }
        self.inner.refresh_lease(now, false).await
    }

    /// The part of every account's rate this replica's lease holds at `now`, from 0 to 1
    /// (`None` without leases).
    #[must_use]
    pub fn leased_fraction(&self, now: Instant) -> Option<f64> {
        let leases = self.inner.leases.as_ref()?;
        Some(leases.fractions(now).0 as f64 / lease::WHOLE as f64)
    }

    /// How long after its last refresh's answer Redis asked this replica to refresh again,
    /// ahead of its period (it was short of its part while another gave its excess back);
    /// `None` when it did not (tests).
    #[cfg(feature = "test-support")]
    #[must_use]
    pub fn lease_asked_again_in(&self) -> Option<Duration> {
        self.inner.leases.as_ref()?.asked_again().map(|(_, after)| after)
    }

    /// The period until the next refresh that Redis gave with its last answer: the
    /// refresh period while anything in the fleet moves, longer while it is settled
    /// ([`AccountLeases::calm_every`](crate::AccountLeases::calm_every)); `None` without
    /// leases (tests).
    #[cfg(feature = "test-support")]
    #[must_use]
    pub fn lease_period(&self) -> Option<Duration> {
        Some(self.inner.leases.as_ref()?.period())
    }

    /// The part of every account's burst this replica's lease holds at `now`, from 0 to 1
    /// (`None` without leases): at least what holds one request of the largest cost.
    #[must_use]
    pub fn leased_burst(&self, now: Instant) -> Option<f64> {
        let leases = self.inner.leases.as_ref()?;
        Some(leases.fractions(now).1 as f64 / lease::WHOLE as f64)
    }
}

/// Renews this replica's lease every period while the store lives and the replica is busy
/// (an acquisition within a lifetime, or a lease held).
pub(super) async fn renew_leases(weak: std::sync::Weak<Inner>, every: Duration) {
    let Some(rearm) = weak.upgrade().and_then(|inner| inner.leases.as_ref().map(|l| l.rearm.clone())) else {
        return;
    };
    let mut next = tokio::time::Instant::now() + every;
    loop {
        let early =
            weak.upgrade().and_then(|inner| inner.leases.as_ref().and_then(|l| l.asked_again())).map(|(at, _)| at);
        // The period's tick or the instant Redis asked for, whichever comes first; an
        // instant asked for meanwhile (the answer to a refresh an acquisition sent) starts
        // the wait over.
        let until = early.map_or(next, |at| at.min(next));
        if tokio::time::timeout_at(until, rearm.notified()).await.is_ok() {
            continue;
        }
        let woke = tokio::time::Instant::now();
        if woke >= next {
            // A tick that comes late delays the ones after it.
            next += every;
            if next <= woke {
                next = woke + every;
            }
        }
        let Some(inner) = weak.upgrade() else { return };
        let Some(leases) = &inner.leases else { return };
        // Asked early or not, this refresh is the one asked for.
        leases.ask_again(None);
        // The caller's clock, estimated: a lease counted from it ends no later than one
        // counted from the real instant.
        let now = leases.estimated_now();
        if leases.idle(now) || inner.breaker.gate() == Gate::Open {
            continue;
        }
        // Asked early, or the period Redis gave is over, or this replica's demand moved.
        let ask = if early.is_some() { Ask::Now } else { Ask::WhenDue };
        inner.refresh_lease_if(now, true, ask).await;
    }
}
