//! Replacing a member's limits while the fleet runs: limits learned from the upstream.
//!
//! The replaced limits live in the pool's hash `<namespace>:{<pool>}:learned`, one field
//! per member's limit (`member:limit`, by place: when it was replaced, its interval and
//! tolerance, and the interval and tolerance it was declared with). Every call of a store
//! built with [`replaceable_limits`](super::RedisAccountsBuilder::replaceable_limits)
//! reads the hash and decides with the replaced limits, so one replica's replacement
//! holds for the fleet at the next call of each. A field counts only while the limit is
//! declared as it was when it was replaced: a fleet restarted with another configuration
//! starts from its own. The hash does not expire (a few fields per pool). A Redis
//! restarted empty forgets it: the first batch of settles after the loss is answered
//! with that news, and each replica sends again the limits it replaced, so the fleet's
//! mirrors decide from the declared limits for about one batch.
//!
//! **A lowered rate meets what the upstream still counts.** The calls admitted at the old
//! pace are still in the upstream's window. Redis keeps what the fleet was charged on each
//! member over the span the upstream counts (its window and the jitter of its answers,
//! given to [`replaceable_limits`](super::RedisAccountsBuilder::replaceable_limits)), in
//! tenths of it: hash `<namespace>:{<pool>}:recent`, written by every charge and settle.
//! A lowered limit's mirror is charged to at least `units × interval − span`, as if those
//! units had been admitted back to back at the new pace from the start of the span
//! (counting the tenth under way as well: at most a tenth more than the span), and what
//! it held is converted to the new pace. The fleet's mirror then waits for the upstream's
//! window to drain instead of sending its burst into it, whichever replica learned the
//! change first: it counts every replica's calls.
//!
//! **Replicas that learn at different times.** A replacement says which way it moves
//! each limit (it lowers a limit whose interval grows, raises the others), as the replica
//! last set it, and Redis applies it only if it moves the fleet's limit that way: a
//! replica that saw fewer answers, and raises from further below, does not undo a raise
//! another replica made since; a lowering always holds.

use std::sync::PoisonError;
use std::sync::atomic::Ordering;

use tower_limits_core::{Instant, LimitSetPolicy};

use super::builder::mirror_of;
use super::{Inner, Op, RedisAccounts};
use crate::error::BuildError;

impl RedisAccounts {
    /// Replaces the limits of the member at `index` (by place) for the whole fleet, with
    /// `policy`: the same limits (names, in order, each counting what it counted) at new
    /// rates and bursts, such as the account's quota learned from its upstream. A lowered
    /// limit is charged with what the fleet admitted over the span the upstream counts
    /// (see the [module docs](self)). The change reaches Redis in the background, with the
    /// settles, and every replica's next call; with
    /// [`leases`](super::RedisAccountsBuilder::leases), this replica's lease decides with a
    /// lowered limit at once, the others' from their next refresh. `now` is the caller's
    /// clock (a store on a manual clock sends it; Redis's own otherwise).
    ///
    /// # Errors
    /// [`BuildError::Invalid`] when the store was not built with
    /// [`replaceable_limits`](super::RedisAccountsBuilder::replaceable_limits), `index` is
    /// not a member, or `policy` does not have the member's limits;
    /// [`BuildError::Policy`] or [`BuildError::Unsupported`] as
    /// [`build`](super::RedisAccountsBuilder::build) for the new limits.
    ///
    /// ```no_run
    /// # async fn run(conn: tower_limits_redis::RedisConnection) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use tower_limits_core::{Instant, LimitPolicy, LimitSetPolicy, Quota, nz};
    /// use tower_limits_redis::RedisAccounts;
    ///
    /// let account = |rpm| LimitSetPolicy::new().limit(LimitPolicy::gcra("rpm", Quota::per_minute(rpm)));
    /// let accounts = RedisAccounts::builder("accounts")
    ///     .member("primary", account(nz!(600)))
    ///     .replaceable_limits(Duration::from_secs(61))
    ///     .build(&conn)?;
    /// // The upstream says the account allows half of it.
    /// accounts.replace_member_limits(0, &account(nz!(300)), Instant::ZERO)?;
    /// # Ok(()) }
    /// ```
    pub fn replace_member_limits(&self, index: usize, policy: &LimitSetPolicy, now: Instant) -> Result<(), BuildError> {
        let invalid = |message: String| BuildError::Invalid { field: "replace_member_limits", message };
        if !self.inner.replaceable {
            return Err(invalid("the store was built without replaceable_limits()".into()));
        }
        let Some(member) = self.inner.members.get(index) else {
            return Err(invalid(format!("no member at {index}: the pool has {}", self.inner.members.len())));
        };
        policy.validate()?;
        let mut shape = member.shape.lock().unwrap_or_else(PoisonError::into_inner);
        let same = policy.limits.len() == shape.len()
            && policy
                .limits
                .iter()
                .zip(shape.iter())
                .all(|(p, l)| p.name == l.name && (p.counts == tower_limits_core::Counts::Cost) == l.cost);
        if !same {
            let names: Vec<&str> = shape.iter().map(|l| l.name.as_str()).collect();
            return Err(invalid(format!(
                "member {:?} has the limits {names:?}, each counting as declared: a replacement keeps them",
                member.name
            )));
        }
        if self.inner.manual_clock {
            self.inner.last_now_us.fetch_max(now.as_nanos() / 1000, Ordering::Relaxed);
        }
        let mut ops = Vec::with_capacity(shape.len());
        let mut max_cost = u64::MAX;
        for (place, p) in policy.limits.iter().enumerate() {
            let (leased, interval, tolerance) = mirror_of(p)?;
            if leased.cost {
                max_cost = max_cost.min(leased.burst);
            }
            let was = shape[place].current.0;
            if interval == was {
                continue;
            }
            ops.push(Op::Replace { member: index, limit: place, interval, tolerance, lowered: interval > was });
        }
        for op in ops {
            if let Op::Replace { limit, interval, tolerance, lowered, .. } = op {
                shape[limit].current = (interval, tolerance);
                if let Some(leases) = self.inner.leases.as_ref().filter(|_| lowered) {
                    leases.lower(index, limit, (interval, tolerance), now);
                }
            }
            self.inner.send(op);
        }
        member.max_cost.store(max_cost, Ordering::Relaxed);
        Ok(())
    }
}

impl Inner {
    /// Redis answered a batch with no replaced limit on record (it restarted empty, or
    /// was flushed): this replica sends again the limits it replaced, each moved from
    /// the declared one.
    pub(super) fn replace_again(&self) {
        for (index, member) in self.members.iter().enumerate() {
            let shape = member.shape.lock().unwrap_or_else(PoisonError::into_inner);
            for (place, l) in shape.iter().enumerate() {
                if l.current != l.declared {
                    let (interval, tolerance) = l.current;
                    let lowered = interval > l.declared.0;
                    self.send(Op::Replace { member: index, limit: place, interval, tolerance, lowered });
                }
            }
        }
    }
}
