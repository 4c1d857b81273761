//! Refresh groups: the backends of one replica whose shares one call refreshes.
//!
//! A service with several limit sets on Redis (a gateway's plans, its budgets) builds a
//! backend for each; refreshed apart, each would cost a call per refresh period, and the
//! fleet's Redis work would grow with the sets as well as the replicas. Backends built
//! into one [`ShareGroup`] report their demand and renew their shares in one call per
//! period (one per Cluster slot), each carried as a part with its own replica id and
//! lifetimes: the script refreshes every part as it would alone. A replica's lease
//! refreshes of its upstream accounts may carry the group's refresh in their own call
//! ([`RedisAccountsBuilder::carry_shares`](crate::RedisAccountsBuilder::carry_shares)):
//! the group's refresh then rides on the first lease refresh three quarters of a period
//! after the last, and the loop sends it alone only when none came half a period after
//! it was due.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use tower_limits_core::Instant;

use super::Shares;
use super::table::{EARLIEST, Table, clock_arg, micros_arg};
use crate::backend::Inner;
use crate::backend::call::int_array;
use crate::connection::RedisConnection;
use crate::stats::bump;

/// Backends that refresh their capacity [`Shares`] together: one call per refresh period
/// (per Cluster slot) carries every member's demand and renews every member's shares.
///
/// Build each backend of a replica with
/// [`RedisBackendBuilder::shares_in`](crate::RedisBackendBuilder::shares_in) and the same
/// group: a gateway with a limit set per plan then costs Redis one refresh a period per
/// replica, however many plans it has. The members share the group's settings, and must
/// be built on one [`RedisConnection`] (or its clones) and the same clock. A backend
/// built with [`RedisBackendBuilder::shares`](crate::RedisBackendBuilder::shares) is a
/// group of one.
///
/// ```no_run
/// use std::time::Duration;
/// use tower_limits_core::{LimitPolicy, LimitSetPolicy, Quota, nz};
/// use tower_limits_redis::{RedisBackend, RedisConnection, ShareGroup, Shares};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let plan = |per_second| {
///     LimitSetPolicy::new()
///         .tiers(["tenant"])
///         .limit(LimitPolicy::gcra("per-tenant", Quota::per_second(per_second)).per("tenant"))
/// };
/// let redis = RedisConnection::connect("redis://127.0.0.1:6379/").await?;
/// let group = ShareGroup::new(Shares::new().refresh_every(Duration::from_millis(200)));
/// let free = RedisBackend::builder(plan(nz!(10))).namespace("plan:free").shares_in(&group).build(&redis)?;
/// let paid = RedisBackend::builder(plan(nz!(100))).namespace("plan:paid").shares_in(&group).build(&redis)?;
/// // One call every 200 ms refreshes the shares of both.
/// # let _ = (free, paid);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct ShareGroup {
    pub(crate) shared: Arc<Group>,
}

impl fmt::Debug for ShareGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShareGroup")
            .field("settings", &self.shared.settings)
            .field("members", &self.shared.live().len())
            .finish()
    }
}

impl ShareGroup {
    /// A group whose members take their shares with `settings`.
    ///
    /// ```
    /// use tower_limits_redis::{ShareGroup, Shares};
    ///
    /// let group = ShareGroup::new(Shares::new());
    /// assert_eq!(group.settings(), Shares::new());
    /// ```
    #[must_use]
    pub fn new(settings: Shares) -> ShareGroup {
        ShareGroup {
            shared: Arc::new(Group {
                settings,
                members: Mutex::new(Vec::new()),
                running: AtomicBool::new(false),
                early: tokio::sync::Notify::new(),
                timing: Mutex::new(Timing::default()),
            }),
        }
    }

    /// The settings every member's shares follow.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_limits_redis::{ShareGroup, Shares};
    ///
    /// let group = ShareGroup::new(Shares::new().lifetime(Duration::from_secs(2)));
    /// assert_eq!(group.settings().share_lifetime(), Duration::from_secs(2));
    /// ```
    pub fn settings(&self) -> Shares {
        self.shared.settings
    }
}

/// What the members of a group share.
pub(crate) struct Group {
    pub(super) settings: Shares,
    members: Mutex<Vec<Weak<Inner>>>,
    running: AtomicBool,
    /// Scopes new to a member turned hot: the loop refreshes them early.
    pub(super) early: tokio::sync::Notify,
    /// When the last whole refresh was sent (alone or carried), and when a carrier (a
    /// lease refresh that may carry the group's) last offered to, on tokio's clock.
    timing: Mutex<Timing>,
}

#[derive(Default)]
struct Timing {
    last: Option<tokio::time::Instant>,
    offered: Option<tokio::time::Instant>,
}

impl Timing {
    /// Whether a carrier at `now` takes the whole refresh of a group refreshed `every`:
    /// three quarters of a period after the last at the earliest.
    fn rides(&self, every: Duration, now: tokio::time::Instant) -> bool {
        self.last.is_none_or(|last| now >= last + every * 3 / 4)
    }

    /// When the loop sends the next whole refresh on its own, seen at `now`: a period
    /// after the last, and half a period later while a carrier offered to carry it
    /// within the last two periods (at once before any).
    fn deadline(&self, every: Duration, now: tokio::time::Instant) -> tokio::time::Instant {
        let Some(last) = self.last else { return now };
        let carried = self.offered.is_some_and(|at| at + every * 2 > now);
        if carried { last + every * 3 / 2 } else { last + every }
    }
}

/// A whole refresh of a group, carried in another script's call (a lease refresh): its
/// keys and arguments (a `G` call's), and the members' parts to apply the answer to.
pub(crate) struct Ride {
    pub(crate) keys: Vec<Arc<str>>,
    pub(crate) args: Vec<String>,
    parts: Vec<Part>,
}

impl Group {
    /// The members still alive, in the order they joined.
    fn live(&self) -> Vec<Arc<Inner>> {
        let mut members = self.members.lock().unwrap_or_else(PoisonError::into_inner);
        members.retain(|m| m.strong_count() > 0);
        members.iter().filter_map(Weak::upgrade).collect()
    }

    /// Why a backend on `connection` (with a manual clock or not) cannot join, if it
    /// cannot: its calls would go to another server, or run on another clock.
    pub(crate) fn refuses(&self, connection: &RedisConnection, manual_clock: bool) -> Option<String> {
        let first = self.live().into_iter().next()?;
        if !first.conn.same_as(connection) {
            return Some("the backends of a share group must be built on one RedisConnection (or its clones)".into());
        }
        if first.settings.manual_clock != manual_clock {
            return Some("the backends of a share group must all run on a manual clock, or none".into());
        }
        None
    }

    /// Whether a member has scopes that turned hot since the last call.
    #[cfg(feature = "test-support")]
    pub(super) fn has_turned_hot(&self) -> bool {
        self.live().iter().any(|m| m.shares.as_ref().is_some_and(|t| t.any_turned_hot()))
    }

    pub(in crate::backend) fn join(&self, inner: &Arc<Inner>) {
        self.members.lock().unwrap_or_else(PoisonError::into_inner).push(Arc::downgrade(inner));
    }

    /// Starts the group's refresh loop on `inner`'s runtime, unless it runs (or the
    /// backends run on a manual clock: their tests refresh by hand).
    pub(super) fn start(self: &Arc<Self>, inner: &Inner) {
        if inner.settings.manual_clock || self.running.swap(true, Ordering::AcqRel) {
            return;
        }
        match inner.handle() {
            Some(handle) => {
                handle.spawn(refresh_loop(self.clone(), self.settings.refresh));
            }
            None => self.running.store(false, Ordering::Release),
        }
    }

    /// Refreshes every member's shares (or, with `turned_hot`, only the scopes new to a
    /// member that turned hot since), one call per slot, sent on the first member's
    /// connection. Each member reports as of `now` (its latest acquisition's instant when
    /// `None`). With `heard` false, the replies are dropped as if lost on the way back
    /// (tests). Answers whether every call succeeded.
    pub(super) async fn refresh(&self, now: Option<Instant>, heard: bool, turned_hot: bool) -> bool {
        let members = self.live();
        let Some(sender) = members.first() else { return false };
        let Some(table) = &sender.shares else { return false };
        if !turned_hot {
            self.lock_timing().last = Some(tokio::time::Instant::now());
        }
        let mut all = true;
        for parts in self.collect(&members, now, turned_hot).into_values() {
            all &= send(sender, table, now, &parts, heard).await;
        }
        all
    }

    /// The members' reports, per slot: each member reports as of `now` (its latest
    /// acquisition's instant when `None`) every scope, or with `turned_hot` the scopes new
    /// to it that turned hot since the last call.
    fn collect(&self, members: &[Arc<Inner>], now: Option<Instant>, turned_hot: bool) -> BTreeMap<u16, Vec<Part>> {
        let mut slots: BTreeMap<u16, Vec<Part>> = BTreeMap::new();
        for member in members {
            let Some(table) = &member.shares else { continue };
            if let Some(now) = now {
                table.latest.fetch_max(now.as_nanos(), Ordering::Relaxed);
            }
            let at = now.unwrap_or_else(|| Instant::from_nanos(table.latest.load(Ordering::Relaxed)));
            let hot = table.take_turned_hot();
            let only = if turned_hot {
                if hot.is_empty() {
                    continue;
                }
                Some(hot)
            } else {
                // A whole refresh carries the scopes that turned hot too.
                None
            };
            for (slot, keys, args) in table.report(member, at, only.as_deref()) {
                slots.entry(slot).or_default().push(Part { member: member.clone(), keys, args, at });
            }
        }
        slots
    }

    /// The group's whole refresh for a carrier's call (a lease refresh), when it is due:
    /// three quarters of a period after the last one at the earliest (always on a manual
    /// clock, where the test decides when refreshes happen). The carrier then hands the
    /// answer to [`Group::landed`]. `None` when it is not due, or nothing is to report.
    pub(crate) fn ride(&self, now: Option<Instant>) -> Option<Ride> {
        let members = self.live();
        let sender = members.first()?;
        let manual = sender.settings.manual_clock;
        {
            let wall = tokio::time::Instant::now();
            let mut timing = self.lock_timing();
            timing.offered = Some(wall);
            if !manual && !timing.rides(self.settings.refresh, wall) {
                return None;
            }
            timing.last = Some(wall);
        }
        let mut slots = self.collect(&members, now, false);
        // (A carrier is never on a cluster: all the keys are in one slot.)
        let parts = slots.remove(&0)?;
        let (keys, args) = call_of(sender, now, &parts);
        bump(&sender.stats.share_refreshes_carried);
        Some(Ride { keys, args, parts })
    }

    /// The answer to a carried refresh (the share script's, without its leading time), or
    /// `None` when the call failed or its answer was lost.
    pub(crate) fn landed(ride: Ride, answers: Option<&[i64]>) {
        match answers {
            Some(answers) if answers.len() == 3 * ride.keys.len() => apply(&ride.parts, answers),
            Some(answers) => {
                tracing::warn!(target: "tower_limits_redis", ?answers, "unexpected answer to a carried share refresh");
            }
            None => {}
        }
    }

    /// When the loop sends the next whole refresh on its own.
    fn deadline(&self) -> tokio::time::Instant {
        self.lock_timing().deadline(self.settings.refresh, tokio::time::Instant::now())
    }

    fn lock_timing(&self) -> std::sync::MutexGuard<'_, Timing> {
        self.timing.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A member's part of a group's call: its scopes' keys and arguments, reported as of `at`.
pub(super) struct Part {
    pub(super) member: Arc<Inner>,
    pub(super) keys: Vec<Arc<str>>,
    pub(super) args: Vec<String>,
    pub(super) at: Instant,
}

/// Sends one `G` call of `parts` (one slot's) on `sender`, and applies its answers unless
/// `heard` is false (tests: lost on the way back). Answers whether it succeeded.
pub(super) async fn send(sender: &Inner, table: &Table, now: Option<Instant>, parts: &[Part], heard: bool) -> bool {
    let (keys, args) = call_of(sender, now, parts);
    bump(&sender.stats.share_refreshes);
    match sender.eval_shares(table, &keys, &args).await {
        Ok(value) => match int_array(&value) {
            Some(reply) if reply.len() == 1 + 3 * keys.len() => {
                if heard {
                    apply(parts, &reply[1..]);
                }
                true
            }
            _ => {
                tracing::warn!(target: "tower_limits_redis", reply = ?value, "unexpected reply from the share script");
                false
            }
        },
        Err(_) => false,
    }
}

/// The keys and arguments of a `G` call of `parts`, for `sender` (its clock).
fn call_of(sender: &Inner, now: Option<Instant>, parts: &[Part]) -> (Vec<Arc<str>>, Vec<String>) {
    let now_us = clock_arg(now.filter(|_| sender.settings.manual_clock));
    let mut keys = Vec::new();
    let mut args = vec!["G".to_owned(), String::new(), now_us, "0".into(), "0".into()];
    args.push(parts.len().to_string());
    for part in parts {
        let Some(t) = &part.member.shares else { continue };
        args.extend([t.replica.to_string(), micros_arg(t.settings.lifetime), micros_arg(t.permit_lease)]);
        args.push(part.keys.len().to_string());
        args.extend(part.args.iter().cloned());
        keys.extend(part.keys.iter().cloned());
    }
    (keys, args)
}

/// Applies a `G` call's answers (without the leading time) to its parts.
fn apply(parts: &[Part], mut answers: &[i64]) {
    for part in parts {
        let Some(t) = &part.member.shares else { continue };
        let (mine, rest) = answers.split_at(3 * part.keys.len());
        t.apply(&part.member, &part.keys, mine, part.at + t.settings.lifetime);
        answers = rest;
    }
}

/// Refreshes every period while a member lives, and, in between, the scopes new to a
/// member that turned hot (at least a tenth of a period after the last call): the others'
/// demand is measured over whole periods. While a carrier (a lease refresh) offers to
/// carry the whole refresh, the loop gives it half a period more before sending it alone.
/// Each member's `now` is the latest an acquisition was given: never later than the
/// clock, so shares expire locally no later than in Redis. Once every member is dropped,
/// the loop ends within a period.
async fn refresh_loop(group: Arc<Group>, every: Duration) {
    let gap = every / EARLIEST;
    let mut last = tokio::time::Instant::now();
    loop {
        let next = group.deadline();
        let early = tokio::time::timeout_at(next, group.early.notified()).await.is_ok();
        if early {
            tokio::time::sleep_until((last + gap).min(next)).await;
        }
        if group.live().is_empty() {
            group.running.store(false, Ordering::Release);
            return;
        }
        last = tokio::time::Instant::now();
        if early && last < next {
            group.refresh(None, true, true).await;
            continue;
        }
        // A carrier may have taken it meanwhile.
        if last >= group.deadline() {
            group.refresh(None, true, false).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Timing;

    #[test]
    fn a_carrier_takes_the_refresh_from_three_quarters_of_a_period_and_the_loop_waits_for_it() {
        let every = Duration::from_millis(1000);
        let t0 = tokio::time::Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut timing = Timing::default();
        assert!(timing.rides(every, t0), "never refreshed: the first carrier takes it");
        assert_eq!(timing.deadline(every, t0), t0, "never refreshed: the loop sends at once");
        timing.last = Some(t0);
        assert!(!timing.rides(every, ms(749)));
        assert!(timing.rides(every, ms(750)));
        // No carrier: a period after the last.
        assert_eq!(timing.deadline(every, ms(10)), ms(1000));
        // A carrier offered lately: half a period more for it.
        timing.offered = Some(ms(400));
        assert_eq!(timing.deadline(every, ms(900)), ms(1500));
        // None for two periods: the loop is on its own again.
        assert_eq!(timing.deadline(every, ms(2400)), ms(1000));
    }
}
