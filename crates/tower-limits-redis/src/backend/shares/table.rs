//! The local bookkeeping of capacity shares: each scope's share, its token bucket or
//! permits in flight, and the demand it reports at the next refresh.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tower_limits_core::{Counts, Instant};

use super::group::Group;
use super::{SCRIPT, ShareLimit, Shares};
use crate::backend::{Inner, LimitInfo};

/// An early refresh comes at least this fraction of the refresh period after the last
/// call.
pub(super) const EARLIEST: u32 = 10;

mod report;

/// This replica's shares.
pub(in crate::backend) struct Table {
    pub(super) settings: Shares,
    pub(super) source: Arc<str>,
    pub(super) sha: Arc<str>,
    pub(super) replica: Arc<str>,
    /// How long Redis counts a semaphore's share without a refresh: the backend's lease,
    /// so that permits in flight stay counted after the share they were taken under ends.
    pub(super) permit_lease: Duration,
    scopes: Mutex<HashMap<Arc<str>, Scope>>,
    pub(super) latest: AtomicU64,
    /// The refresh group this table is refreshed with (a group of its own unless the
    /// backend was built into one).
    pub(super) group: Arc<Group>,
    /// Scopes new to this replica that turned hot without a share: the group's refresh
    /// loop refreshes them early rather than leave them with the pool, a call per request,
    /// for the rest of the period.
    turned_hot: Mutex<Vec<Arc<str>>>,
    /// Counts the semaphore fetches answered (or given up): requests that found a fetch of
    /// their scope in flight wait for the next count rather than send one of their own.
    pub(super) fetch_done: tokio::sync::watch::Sender<u64>,
}

struct Scope {
    limit: usize,
    share: u64,
    burst: u64,
    expires: Instant,
    /// Units times the period in nanoseconds: the bucket refills by `share` a nanosecond.
    tokens: i128,
    at: Instant,
    pending: Option<Pending>,
    asks: u32,
    /// Units asked for since the last report; for permits, the most held or asked at once.
    wanted: u64,
    /// Rates: units taken out of the bucket when its share shrank, for the pool.
    returned: u64,
    reported: Instant,
    quiet: u8,
    /// Permits held by this replica's grants.
    in_flight: u64,
    /// Permits asked for by requests waiting for this scope's share to be fetched: part
    /// of the demand each of those fetches reports, so that requests arriving together
    /// before the first share are all counted.
    fetching: u64,
    /// Fetches of this scope's share in flight.
    fetches: u32,
    /// Permits: no share to be had until then (the last fetch found every permit held).
    denied_until: Instant,
    /// Rates and windows: the pool refused this scope; its share alone decides until then.
    pool_dry_until: Instant,
    /// Rates: units the pool booked for this replica, due from `booked_from` (no earlier
    /// than Redis made them due) and usable until `booked_until` (no later than Redis
    /// holds them): a request for this scope that the share cannot grant takes them with
    /// no call.
    booked: u64,
    booked_from: Instant,
    booked_until: Instant,
    /// Windows: the start of the window the block is of, as the script is told; its end,
    /// as the script is told and on this clock; the units spent from blocks in it (net of
    /// settles), all told; and the window the last report was of. A window's `tokens` are
    /// the units of its block (not times a period).
    window: u64,
    window_end_us: u64,
    window_end: Instant,
    spent: i128,
    reported_window: u64,
    /// Windows: the last report said the scope holds nothing and wants nothing, and was
    /// answered: Redis no longer keeps its spending, so the scope may be forgotten.
    reported_idle: bool,
    released: bool,
    /// Not yet reported: turning hot, the scope asks for an early refresh.
    new: bool,
}

/// A refresh's answer, applied by the next acquisition (whose `now` is after it).
#[derive(Clone, Copy)]
struct Pending {
    share: u64,
    burst: u64,
    gift: u64,
    expires: Instant,
}

impl Scope {
    fn new(limit: usize, now: Instant) -> Scope {
        Scope {
            limit,
            share: 0,
            burst: 0,
            expires: now,
            tokens: 0,
            at: now,
            pending: None,
            asks: 0,
            wanted: 0,
            returned: 0,
            reported: now,
            quiet: 0,
            in_flight: 0,
            fetching: 0,
            fetches: 0,
            denied_until: now,
            pool_dry_until: now,
            booked: 0,
            booked_from: now,
            booked_until: now,
            window: 0,
            window_end_us: 0,
            window_end: now,
            spent: 0,
            reported_window: 0,
            reported_idle: false,
            released: false,
            new: true,
        }
    }

    /// A window's scope brought to the window holding `now`: a block of an earlier window
    /// is worth nothing in this one, and its spending is that window's.
    fn roll(&mut self, info: &LimitInfo, l: &ShareLimit, manual: bool, now: Instant) {
        if now < self.window_end {
            return;
        }
        let (start, end_us, end) = window_at(info, l, manual, now);
        if start != self.window {
            self.window = start;
            self.tokens = 0;
            self.spent = 0;
        }
        self.window_end_us = end_us;
        self.window_end = end;
    }

    /// A window's block, usable until it expires.
    fn block(&self, now: Instant) -> i128 {
        if now < self.expires { self.tokens } else { self.tokens.min(0) }
    }

    /// Brings the bucket to `now`: refilled at the share until it expires, an expired
    /// share dropped (a debt is kept).
    fn advance(&mut self, l: &ShareLimit, now: Instant) {
        let p = l.period_ns();
        if now > self.at {
            let until = if now < self.expires { now } else { self.expires.max(self.at) };
            let refill = i128::from(until.nanos_since(self.at)) * i128::from(self.share);
            self.tokens = (self.tokens + refill).min(i128::from(self.burst) * p);
            self.at = now;
        }
        if now >= self.expires && self.share > 0 {
            self.share = 0;
            self.burst = 0;
            self.tokens = self.tokens.min(0);
        }
    }

    /// Applies the last refresh's answer, at an acquisition's `now`: after the answer
    /// came, up to the time between reading the clock and deciding (the same tolerance
    /// as racing callers of the in-memory set). A refresh never applies it: its `now` may
    /// lag the clock.
    fn take_pending(&mut self, l: &ShareLimit, now: Instant) {
        self.advance(l, now);
        if let Some(next) = self.pending.take() {
            let p = l.period_ns();
            self.share = next.share;
            self.burst = next.burst;
            self.expires = next.expires;
            // Tokens above a smaller burst go back to the pool at the next refresh: dropped,
            // a share that shrinks and grows with its demand would drain the pool.
            let excess = self.tokens - i128::from(self.burst) * p;
            if excess >= p {
                let units = excess / p;
                self.returned = self.returned.saturating_add(u64::try_from(units).unwrap_or(u64::MAX));
                self.tokens -= units * p;
            }
            self.tokens = (self.tokens + i128::from(next.gift) * p).min(i128::from(self.burst) * p);
            self.advance(l, now);
        }
    }

    /// The share this replica may be using, as Redis must keep counting it.
    fn using(&self, now: Instant) -> u64 {
        let live = |share, expires| if now < expires { share } else { 0 };
        let pending = self.pending.map_or(0, |p| live(p.share, p.expires));
        live(self.share, self.expires).max(pending)
    }
}

/// One limit's part of a grant from shares.
#[derive(Debug, Clone)]
pub(in crate::backend) struct Part {
    pub(in crate::backend) limit: usize,
    pub(in crate::backend) scope: Arc<str>,
    pub(in crate::backend) units: u64,
    /// A window's part: the start and end of the window it was granted in, as the script
    /// is told (0 for the others).
    pub(in crate::backend) window: u64,
    pub(in crate::backend) window_end: u64,
}

/// A grant from shares: what it took locally and from the pools.
#[derive(Debug)]
pub(in crate::backend) struct SharedGrant {
    pub(in crate::backend) local: Vec<Part>,
    pub(in crate::backend) pooled: Vec<Part>,
    pub(in crate::backend) charged: u64,
}

/// What the local shares decided.
pub(super) enum Local {
    Granted(SharedGrant),
    /// Refused by a share: a rate's exact wait, or a semaphore's (wait for a release).
    Refused {
        limit: usize,
        wait: Duration,
        release: bool,
    },
    /// The local parts are taken; the cold ones must come from the pools.
    Pool {
        local: Vec<Part>,
        cold: Vec<Part>,
    },
    /// Semaphores without a share, or with one too small: it must be fetched first
    /// (nothing is taken). Each scope with the permits asked, counted as being fetched,
    /// and the fetch as in flight, until [`Table::fetched`].
    Fetch(Vec<(Arc<str>, u64)>),
    /// As [`Local::Fetch`], but every scope's fetch is in flight already: the request
    /// waits until the fetch count moves past the one given, its permits counted in the
    /// demand of the next fetch meanwhile, then decides again.
    AwaitFetch(Vec<(Arc<str>, u64)>, u64),
}

impl Table {
    pub(in crate::backend) fn new(group: Arc<Group>, replica: u64, permit_lease: Duration) -> Table {
        let settings = group.settings;
        let source: Arc<str> = SCRIPT.into();
        let sha: Arc<str> = redis::Script::new(SCRIPT).get_hash().into();
        Table {
            settings,
            source,
            sha,
            replica: format!("{replica:016x}").into(),
            permit_lease: permit_lease.max(settings.lifetime),
            scopes: Mutex::new(HashMap::new()),
            latest: AtomicU64::new(0),
            group,
            turned_hot: Mutex::new(Vec::new()),
            fetch_done: tokio::sync::watch::Sender::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, Scope>> {
        self.scopes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Decides what the shares can, taking from them; the rest goes to the pools, or
    /// waits for a semaphore's share to be fetched: by a fetch of its own, or, with
    /// `may_wait`, by one already in flight for every scope it needs.
    pub(super) fn decide(&self, inner: &Inner, keys: Vec<String>, cost: u64, now: Instant, may_wait: bool) -> Local {
        self.latest.fetch_max(now.as_nanos(), Ordering::Relaxed);
        let mut scopes = self.lock();
        let (mut local, mut cold, mut fetch) = (Vec::new(), Vec::new(), Vec::<(Arc<str>, u64)>::new());
        // The rates' scopes and units: their demand, unless a semaphore refuses.
        let mut rates: Vec<(Arc<str>, u64)> = Vec::new();
        // The limit that refuses, its wait in ns, and whether it waits for a release.
        let mut refused: Option<(usize, u64, bool)> = None;
        let mut turned_hot = Vec::new();
        for (i, key) in keys.into_iter().enumerate() {
            let info = &inner.limits[i];
            let Some(l) = info.share else { continue };
            let units = if info.counts == Counts::Cost { cost } else { 1 };
            let tracked = scopes.contains_key(key.as_str()) || scopes.len() < self.settings.max_scopes;
            let scope: Arc<str> = key.into();
            if !tracked {
                if l.permits {
                    // No room to track a share: refused as a full semaphore would be.
                    refused.get_or_insert((i, 0, true));
                } else if l.window {
                    // The pool counts in the window the caller names.
                    let (window, window_end, _) = window_at(info, &l, inner.settings.manual_clock, now);
                    cold.push(Part { limit: i, scope, units, window, window_end });
                } else {
                    cold.push(Part { limit: i, scope, units, window: 0, window_end: 0 });
                }
                continue;
            }
            let s = scopes.entry(scope.clone()).or_insert_with(|| Scope::new(i, now));
            s.asks = s.asks.saturating_add(1);
            if l.window {
                s.roll(info, &l, inner.settings.manual_clock, now);
                if s.new && s.asks == self.settings.hot_after && s.tokens <= 0 {
                    turned_hot.push(scope.clone());
                }
                rates.push((scope.clone(), units));
                let (window, window_end) = (s.window, s.window_end_us);
                if s.block(now) >= i128::from(units) {
                    local.push(Part { limit: i, scope, units, window, window_end });
                } else if now >= s.pool_dry_until {
                    cold.push(Part { limit: i, scope, units, window, window_end });
                } else {
                    let wait = s.pool_dry_until.nanos_since(now);
                    if refused.is_none_or(|(_, w, _)| wait > w) {
                        refused = Some((i, wait, false));
                    }
                }
                continue;
            }
            s.take_pending(&l, now);
            if l.permits {
                s.wanted = s.wanted.max(s.in_flight.saturating_add(s.fetching).saturating_add(units));
                if s.share == 0 {
                    if now < s.denied_until {
                        refused.get_or_insert((i, 0, true));
                    } else {
                        fetch.push((scope, units));
                    }
                } else if s.in_flight.saturating_add(units) <= s.share {
                    local.push(Part { limit: i, scope, units, window: 0, window_end: 0 });
                } else if now < s.denied_until {
                    refused.get_or_insert((i, 0, true));
                } else {
                    // The share is short: permits may be free elsewhere (a share is sized
                    // by the demand of the last period). One call asks for more, reporting
                    // the demand; still short, the scope refuses locally until the next
                    // refresh period.
                    fetch.push((scope, units));
                }
                continue;
            }
            rates.push((scope.clone(), units));
            if s.share == 0 || units > s.burst {
                if s.new
                    && s.share == 0
                    && s.pending.is_none()
                    && s.asks == self.settings.hot_after
                    && l.burst >= self.settings.min_burst
                {
                    turned_hot.push(scope.clone());
                }
                if now < s.pool_dry_until {
                    // The pool refused this scope and refills no sooner: refused locally
                    // with the pool's wait, no call (a thin rate's retries on one replica).
                    let wait = s.pool_dry_until.nanos_since(now);
                    if refused.is_none_or(|(_, w, _)| wait > w) {
                        refused = Some((i, wait, false));
                    }
                    continue;
                }
                cold.push(Part { limit: i, scope, units, window: 0, window_end: 0 });
                continue;
            }
            let need = i128::from(units) * l.period_ns();
            if s.tokens >= need {
                local.push(Part { limit: i, scope, units, window: 0, window_end: 0 });
            } else if now >= s.pool_dry_until {
                // The share is spent: the pool may hold what no share does (a burst after
                // a quiet spell). Refused there, the scope refuses locally until the pool
                // could have it: one call per such wait, not per request.
                cold.push(Part { limit: i, scope, units, window: 0, window_end: 0 });
            } else {
                let missing = u64::try_from(need - s.tokens).unwrap_or(u64::MAX);
                let wait = missing.div_ceil(s.share).min(s.pool_dry_until.nanos_since(now));
                if refused.is_none_or(|(_, w, _)| wait > w) {
                    refused = Some((i, wait, false));
                }
            }
        }
        // A request a semaphore refuses asks nothing of the rates: counted, its retries
        // would claim rate its tenant cannot use, and leave the pool dry for the others.
        if !matches!(refused, Some((_, _, true))) {
            for (scope, units) in rates {
                if let Some(s) = scopes.get_mut(&scope) {
                    s.wanted = s.wanted.saturating_add(units);
                }
            }
        }
        if !turned_hot.is_empty() {
            self.turned_hot.lock().unwrap_or_else(PoisonError::into_inner).append(&mut turned_hot);
            self.group.early.notify_one();
        }
        if let Some((limit, wait, release)) = refused {
            return Local::Refused { limit, wait: Duration::from_nanos(wait), release };
        }
        if !fetch.is_empty() {
            // Requests arriving together share a fetch rather than send one each: the
            // fetch in flight answers them, and the next one counts them all.
            let wait = may_wait && fetch.iter().all(|(k, _)| scopes.get(k).is_some_and(|s| s.fetches > 0));
            for (scope, units) in &fetch {
                if let Some(s) = scopes.get_mut(scope) {
                    s.fetching = s.fetching.saturating_add(*units);
                    if !wait {
                        s.fetches = s.fetches.saturating_add(1);
                    }
                }
            }
            if wait {
                return Local::AwaitFetch(fetch, *self.fetch_done.borrow());
            }
            return Local::Fetch(fetch);
        }
        for part in &local {
            if let (Some(s), Some(l)) = (scopes.get_mut(&part.scope), inner.limits[part.limit].share) {
                if l.permits {
                    s.in_flight += part.units;
                } else if l.window {
                    s.tokens -= i128::from(part.units);
                    s.spent += i128::from(part.units);
                } else {
                    s.tokens -= i128::from(part.units) * l.period_ns();
                }
            }
        }
        if cold.is_empty() {
            return Local::Granted(SharedGrant { local, pooled: Vec::new(), charged: cost });
        }
        // Units the pool booked for this replica and now due cover the pools' part: granted
        // with no call, as if the pool had granted them (settles go to the pool).
        let due = |p: &Part| {
            scopes.get(&p.scope).is_some_and(|s| {
                s.booked >= p.units && s.booked_from <= now && now < s.booked_until && p.window_end == 0
            })
        };
        if cold.iter().all(due) {
            for part in &cold {
                if let Some(s) = scopes.get_mut(&part.scope) {
                    s.booked -= part.units;
                }
            }
            return Local::Granted(SharedGrant { local, pooled: cold, charged: cost });
        }
        Local::Pool { local, cold }
    }

    /// The pool booked `units` of `scope` for this replica, due from `from` and usable
    /// until `until`; the scope is refused locally until they are due.
    pub(super) fn book(&self, scope: &Arc<str>, units: u64, from: Instant, until: Instant) {
        if let Some(s) = self.lock().get_mut(scope) {
            (s.booked, s.booked_from, s.booked_until) = (units, from, until);
            s.pool_dry_until = from;
        }
    }

    /// Undoes what [`Table::decide`] took for parts that were not granted after all: the
    /// rates' tokens and the semaphores' permits. A scope forgotten meanwhile keeps what
    /// it took: charged, never generous.
    pub(super) fn undo(&self, inner: &Inner, parts: &[Part]) {
        let mut scopes = self.lock();
        for part in parts {
            if let (Some(s), Some(l)) = (scopes.get_mut(&part.scope), inner.limits[part.limit].share) {
                if l.permits {
                    s.in_flight = s.in_flight.saturating_sub(part.units);
                } else if l.window {
                    if part.window == s.window {
                        s.tokens += i128::from(part.units);
                        s.spent -= i128::from(part.units);
                    }
                } else {
                    let p = l.period_ns();
                    s.tokens = (s.tokens + i128::from(part.units) * p).min(i128::from(s.burst) * p);
                }
            }
        }
    }

    /// The pool of `scope` refused until `until`: its share alone decides until then.
    pub(super) fn pool_dry(&self, scope: &Arc<str>, until: Instant) {
        if let Some(s) = self.lock().get_mut(scope) {
            s.pool_dry_until = until;
        }
    }

    /// Whether scopes turned hot since the last call.
    #[cfg(feature = "test-support")]
    pub(super) fn any_turned_hot(&self) -> bool {
        !self.turned_hot.lock().unwrap_or_else(PoisonError::into_inner).is_empty()
    }

    /// The scopes that turned hot since the last call.
    pub(super) fn take_turned_hot(&self) -> Vec<Arc<str>> {
        std::mem::take(&mut *self.turned_hot.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The permits `scope`'s share holds, or will once the last refresh's answer applies.
    pub(super) fn permits_of(&self, scope: &Arc<str>) -> u64 {
        self.lock().get(scope).map_or(0, |s| s.share.max(s.pending.map_or(0, |p| p.share)))
    }

    /// What is left of the window `scope` is in (zero for a scope no longer tracked).
    pub(super) fn window_left(&self, scope: &Arc<str>, now: Instant) -> Duration {
        self.lock().get(scope).map_or(Duration::ZERO, |s| Duration::from_nanos(s.window_end.nanos_since(now)))
    }

    /// Gives back the permits of a grant's semaphore parts.
    pub(in crate::backend) fn release(&self, inner: &Inner, grant: &SharedGrant) {
        let mut scopes = self.lock();
        for part in &grant.local {
            if let (Some(s), Some(l)) = (scopes.get_mut(&part.scope), inner.limits[part.limit].share) {
                if l.permits {
                    s.in_flight = s.in_flight.saturating_sub(part.units);
                }
            }
        }
    }

    /// Whether a grant holds permits.
    pub(in crate::backend) fn holds_permits(inner: &Inner, grant: &SharedGrant) -> bool {
        grant.local.iter().any(|p| inner.limits[p.limit].share.is_some_and(|l| l.permits))
    }

    /// A request's wait for these scopes' shares ended (answered, failed or dropped): its
    /// permits are no longer counted as being fetched; with `sent`, the request's own
    /// fetch ended, and the requests waiting for it decide again.
    pub(super) fn fetched(&self, parts: &[(Arc<str>, u64)], sent: bool) {
        let mut table = self.lock();
        for (key, units) in parts {
            if let Some(s) = table.get_mut(key) {
                s.fetching = s.fetching.saturating_sub(*units);
                if sent {
                    s.fetches = s.fetches.saturating_sub(1);
                }
            }
        }
        if sent {
            self.fetch_done.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Marks semaphore scopes whose fetch found no permit free for the request (no share,
    /// or one still too small): refused locally until `until`, unless a refresh grows
    /// the share enough meanwhile.
    pub(super) fn deny(&self, scopes: &[(Arc<str>, u64)], until: Instant) {
        let mut table = self.lock();
        for (key, _) in scopes {
            if let Some(s) = table.get_mut(key) {
                if s.pending.is_none_or(|p| p.share <= s.share) {
                    s.denied_until = until;
                }
            }
        }
    }

    /// Gives `units` back to (or, negative, charges them from) each part's local share.
    /// Answers the parts whose scope this replica no longer tracks (or whose window's
    /// block has ended): their pools must be settled instead.
    pub(super) fn adjust(
        &self,
        inner: &Inner,
        parts: &[Part],
        now: Instant,
        units: impl Fn(&Part) -> i128,
    ) -> Vec<Part> {
        let mut scopes = self.lock();
        let mut gone = Vec::new();
        for part in parts {
            match (scopes.get_mut(&part.scope), inner.limits[part.limit].share) {
                (_, Some(l)) if l.permits => {}
                (Some(s), Some(l)) if l.window => {
                    s.roll(&inner.limits[part.limit], &l, inner.settings.manual_clock, now);
                    if part.window != s.window {
                        // A grant of a window that has ended is neither refunded nor charged.
                    } else if now < s.expires {
                        s.tokens += units(part);
                        s.spent -= units(part);
                        s.released = false;
                    } else {
                        gone.push(part.clone());
                    }
                }
                (Some(s), Some(l)) => {
                    let p = l.period_ns();
                    s.tokens = (s.tokens + units(part) * p).min(i128::from(s.burst) * p);
                }
                _ => gone.push(part.clone()),
            }
        }
        gone
    }

    /// The first arguments of a call of `op` by `inner` at `now`: the operation, the
    /// replica, the caller's clock, the shares' lifetime and `held` (how long a permit is
    /// leased; for a booking, how long at least it is held once due).
    pub(super) fn args_head(&self, inner: &Inner, op: &str, now: Instant, held: Duration) -> Vec<String> {
        let now = clock_arg(inner.settings.manual_clock.then_some(now));
        vec![op.to_owned(), self.replica.to_string(), now, micros_arg(self.settings.lifetime), micros_arg(held)]
    }
}

/// The caller's clock as the script is told it: microseconds of a manual clock, or empty
/// for the server's own.
pub(super) fn clock_arg(manual: Option<Instant>) -> String {
    manual.map_or_else(String::new, |now| (now.as_nanos() / 1000).to_string())
}

/// A duration as the script is told it, in microseconds.
pub(super) fn micros_arg(d: Duration) -> String {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX).to_string()
}

/// The window of `info` holding `now`: its start and end as the script is told
/// (microseconds of the caller's clock with a manual one, of the Unix epoch otherwise,
/// below 2^53), and its end on this clock.
fn window_at(info: &LimitInfo, l: &ShareLimit, manual: bool, now: Instant) -> (u64, u64, Instant) {
    let us = |n: i128| u64::try_from(n.div_euclid(1000).clamp(0, (1 << 53) - 1)).unwrap_or(0);
    if let Some(w) = &info.calendar {
        let (start, end) = w.period_at(now);
        if manual {
            return (start.as_nanos() / 1000, end.as_nanos() / 1000, end);
        }
        let (start_unix, end_unix) = w.unix_period_at(now);
        return (us(start_unix), us(end_unix), end);
    }
    let len = i128::from(l.period_us.max(1)) * 1000;
    let at = i128::from(now.as_nanos()) + if manual { 0 } else { unix_origin_ns() };
    let start = at - at.rem_euclid(len);
    let left = u64::try_from(start + len - at).unwrap_or(u64::MAX);
    (us(start), us(start + len), Instant::from_nanos(now.as_nanos().saturating_add(left)))
}

/// The Unix time, in nanoseconds, at which this process's clocks read zero.
fn unix_origin_ns() -> i128 {
    let origin = tower_limits_core::time::unix_origin();
    origin.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| i128::try_from(d.as_nanos()).unwrap_or(0))
}
