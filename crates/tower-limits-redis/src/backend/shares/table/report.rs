//! What a refresh carries for each scope, and what its answer does: a rate's share and
//! demand, a window's block and spending, a semaphore's permits.

use std::collections::HashMap;
use std::sync::Arc;

use tower_limits_core::Instant;

use super::{Pending, Scope, Table};
use crate::backend::Inner;
use crate::backend::shares::ShareLimit;
use crate::keys::key_slot;

impl Table {
    /// This refresh's report: keys and arguments per slot group, with the scopes in order.
    pub(in crate::backend::shares) fn report(
        &self,
        inner: &Inner,
        now: Instant,
        only: Option<&[Arc<str>]>,
    ) -> Vec<(u16, Vec<Arc<str>>, Vec<String>)> {
        let mut scopes = self.lock();
        let mut groups: HashMap<u16, (Vec<Arc<str>>, Vec<String>)> = HashMap::new();
        let cluster = inner.conn.is_cluster();
        let hot_after = self.settings.hot_after;
        let min_burst = self.settings.min_burst;
        let refresh_ns = u64::try_from(self.settings.refresh.as_nanos()).unwrap_or(u64::MAX).max(1);
        scopes.retain(|key, s| {
            let Some(l) = inner.limits[s.limit].share else { return false };
            if only.is_some_and(|keys| !keys.contains(key)) {
                return true;
            }
            s.new = false;
            if l.window {
                let info = &inner.limits[s.limit];
                s.roll(info, &l, inner.settings.manual_clock, now);
                return report_window(key, s, &l, now, refresh_ns, hot_after, cluster, &mut groups);
            }
            s.advance(&l, now);
            if l.permits {
                return report_permits(key, s, &l, now, cluster, &mut groups);
            }
            let elapsed = now.nanos_since(s.reported).max(refresh_ns);
            let mut using = s.using(now);
            // A scope holding a share keeps it while it has requests: a tenant whose pace
            // hovers near `hot_after` would otherwise hand its tokens to the pool and take
            // them back period after period, each time starting from what the pool gives.
            // A thin rate is not split: its scopes stay with the pool.
            let hot = l.burst >= min_burst && (s.asks >= hot_after || (using > 0 && s.asks > 0));
            let mut back = 0;
            let demand = if hot {
                let per_period = u128::from(s.wanted) * u128::from(l.period_us) * 1000 / u128::from(elapsed);
                u64::try_from(per_period * 5 / 4 + 1).unwrap_or(u64::MAX).min(l.amount)
            } else {
                if using > 0 || s.tokens < 0 {
                    // Idle: the share and its tokens go back to the pool, and a debt (a
                    // settle that charged more than was taken) is charged to it.
                    back = i64::try_from(s.tokens.div_euclid(l.period_ns())).unwrap_or(0);
                    s.share = 0;
                    s.burst = 0;
                    s.tokens = 0;
                    s.pending = None;
                    using = 0;
                } else if s.asks == 0 {
                    s.quiet += 1;
                }
                0
            };
            if using == 0 && s.tokens < 0 {
                // A debt where no share can repay it is the pool's.
                back = i64::try_from(s.tokens.div_euclid(l.period_ns())).unwrap_or(0);
                s.tokens = 0;
            }
            back = back.saturating_add(i64::try_from(std::mem::take(&mut s.returned)).unwrap_or(i64::MAX));
            let report = hot || back != 0;
            s.asks = 0;
            s.wanted = 0;
            s.reported = now;
            if report {
                s.quiet = 0;
                let slot = if cluster { key_slot(key) } else { 0 };
                let (keys, args) = groups.entry(slot).or_default();
                keys.push(key.clone());
                for n in [l.amount, l.period_us, l.burst, using, demand] {
                    args.push(n.to_string());
                }
                args.push(back.to_string());
            }
            s.quiet < 2
        });
        groups.into_iter().map(|(slot, (keys, args))| (slot, keys, args)).collect()
    }

    pub(in crate::backend::shares) fn apply(
        &self,
        inner: &Inner,
        keys: &[Arc<str>],
        answers: &[i64],
        expires: Instant,
    ) {
        let mut scopes = self.lock();
        let at = |v: i64| u64::try_from(v).unwrap_or(0);
        for (k, key) in keys.iter().enumerate() {
            let (Some(s), Some(r)) = (scopes.get_mut(key), answers.get(3 * k..3 + 3 * k)) else { continue };
            let Some(l) = inner.limits[s.limit].share else { continue };
            if l.window {
                // Applied at once: a block is units, not a rate from an instant. A reply to a
                // report of another window, or from a table already in a later one, gives
                // nothing.
                if s.reported_window != s.window || r[1] < 0 {
                    continue;
                }
                s.released = s.reported_idle;
                let held = s.tokens.max(0);
                s.tokens += i128::from(r[0]).max(-held);
                s.expires = expires;
                continue;
            }
            s.pending = Some(Pending { share: at(r[0]), burst: at(r[1]), gift: at(r[2]), expires });
        }
    }
}

/// A window scope's part of a report: the block it holds (a block that ended is counted
/// spent in Redis, and a debt is in its spending), the block it wants (two refresh
/// periods of its demand, with a quarter of headroom, while it is busy) and its spending
/// in the window, all told. Idle, its block goes back.
/// Answers whether to keep tracking the scope.
#[allow(clippy::too_many_arguments)]
fn report_window(
    key: &Arc<str>,
    s: &mut Scope,
    l: &ShareLimit,
    now: Instant,
    refresh_ns: u64,
    hot_after: u32,
    cluster: bool,
    groups: &mut HashMap<u16, (Vec<Arc<str>>, Vec<String>)>,
) -> bool {
    s.tokens = s.block(now);
    let had = s.tokens > 0;
    let hot = s.asks >= hot_after || (had && s.asks > 0);
    let demand = if hot {
        let elapsed = u128::from(now.nanos_since(s.reported).max(refresh_ns));
        let per_period = u128::from(s.wanted) * u128::from(refresh_ns) / elapsed;
        u64::try_from((per_period * 5 / 4 + 1) * 2).unwrap_or(u64::MAX).min(l.amount)
    } else {
        s.tokens = s.tokens.min(0);
        0
    };
    // A debt is in the spending reported: the block starts again from nothing.
    let held = u64::try_from(s.tokens.max(0)).unwrap_or(u64::MAX);
    s.tokens = s.tokens.max(0);
    // Until Redis has heard it holds nothing, the scope reports: forgotten and made anew,
    // its spending would start again from zero while Redis still counts the old figure.
    let report = hot || had || (s.spent != 0 && !s.released);
    s.asks = 0;
    s.wanted = 0;
    s.reported = now;
    if !report {
        s.quiet += 1;
        return s.quiet < 2;
    }
    s.quiet = 0;
    s.reported_window = s.window;
    s.reported_idle = held == 0 && demand == 0;
    s.released = false;
    let slot = if cluster { key_slot(key) } else { 0 };
    let (keys, args) = groups.entry(slot).or_default();
    keys.push(key.clone());
    args.push(l.amount.to_string());
    args.push(format!("{}:{}", s.window, s.window_end_us));
    args.push("-1".into());
    args.push(held.to_string());
    args.push(demand.to_string());
    args.push(s.spent.to_string());
    true
}

/// A semaphore scope's part of a report: the permits it may be using (held ones
/// included: a share shrinks only as its permits come back), and the most it held or was
/// asked at once in the period, exactly (a margin would take permits another replica's
/// tenant needs), or, refused for want of permits, since the refusals began; idle for a
/// period, its share goes back.
/// Answers whether to keep tracking the scope.
fn report_permits(
    key: &Arc<str>,
    s: &mut Scope,
    l: &ShareLimit,
    now: Instant,
    cluster: bool,
    groups: &mut HashMap<u16, (Vec<Arc<str>>, Vec<String>)>,
) -> bool {
    // Requests waiting for a fetch count until it is answered: fetches sent together
    // each report them all, whichever is answered last.
    let asked = s.in_flight.saturating_add(s.fetching);
    // Refused for want of permits: its demand stands until the refusals end, so that the
    // refreshes meanwhile make room for it (its clients are waiting to ask again).
    let denied = now < s.denied_until;
    let busy = s.asks > 0 || asked > 0 || denied;
    let demand = if busy { s.wanted.max(asked).min(l.amount) } else { 0 };
    if !busy {
        s.share = 0;
        s.pending = None;
    }
    let using = s.using(now).max(s.in_flight);
    s.asks = 0;
    s.wanted = if denied { s.wanted.max(s.in_flight) } else { s.in_flight };
    s.reported = now;
    if using == 0 && demand == 0 {
        s.quiet += 1;
        return s.quiet < 2;
    }
    s.quiet = 0;
    let slot = if cluster { key_slot(key) } else { 0 };
    let (keys, args) = groups.entry(slot).or_default();
    keys.push(key.clone());
    for n in [l.amount, l.period_us, 0, using, demand, 0] {
        args.push(n.to_string());
    }
    true
}
