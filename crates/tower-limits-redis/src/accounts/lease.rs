//! Account leases: each replica decides the accounts alone, from a part of every member
//! that it leases from Redis, and asks Redis once per refresh for all of them.
//!
//! # The scheme
//!
//! A replica holds two fractions of the pool, counted in millionths: a fraction `g` of
//! every member's rates and a fraction `h` of every member's bursts. For a limit of `A`
//! units per period `P` with burst `B`, it runs a token bucket of its own, refilled at
//! `g·A` per `P` and holding at most `h·B`, and admits from it with no round trip,
//! choosing the member with the most headroom as the per-request script does. Settles,
//! cancels and the upstream's `x-ratelimit-remaining-*` correct the bucket that granted,
//! locally; a `Retry-After` still benches the member for the whole fleet.
//!
//! At every refresh a busy replica sends one call: the fractions
//! it may still be using, the most rate it could use (its *cap*: everything while it
//! refuses or has requests waiting, else twice what it admitted in the last period), and,
//! with [`fleet`](super::RedisAccountsBuilder::fleet), its fair queue's demand per
//! tenant and band. The script divides the rates by weighted max-min fairness over the
//! live replicas. A replica's weight in a band is `Σ_t w_t·s_t` over its tenants waiting
//! there, `s_t` its part of tenant `t`'s demand across the fleet, so that tenant `t` gets
//! capacity in proportion to its weight whichever replicas its requests land on. The
//! bands divide the rate as one fair queue would: each later band with work anywhere its
//! minimum share, the first band with work the rest, and a replica's weight is the sum
//! over bands of the band's part times the replica's part of the band's weight. A
//! replica's weights move three tenths of the way toward what each refresh reports: the
//! requests waiting swing from one refresh to the next, and every part of a rate that
//! moves between replicas is idle from the giver's confirmation (below) to the taker's
//! next refresh. A band whose weight was zero counts at once: a replica's first demand (a
//! fleet starting, or work after a quiet spell) would otherwise take five periods to
//! reach its part. For the same reason a rate
//! part within 1% of the one held is left as it is, unless it grows into what no replica
//! holds (that moves nobody's part, and left alone it would be nobody's).
//!
//! How often it refreshes follows how still the fleet is. While capacity moves, every
//! refresh period (100 ms by default). Once every live replica that wants capacity holds
//! some, and what it is allotted within 4% of the whole (the allotments swing by a few
//! hundredths from one refresh to the next with the requests each replica has waiting,
//! and moving such a part mends nothing), the fleet is settled: each answer doubles the
//! period until the next refresh,
//! up to the calm period ([`AccountLeases::calm_every`], four refresh periods by
//! default), and any answer that finds something moving gives the refresh period again.
//! Between refreshes the replica looks at its own demand every refresh period, locally,
//! and refreshes at once when it moved: a band started or stopped waiting, the replica
//! turned idle or busy, turned short of its part or stopped being short, was asked a
//! request its burst part cannot hold, or holds a tenth of the whole more than it could
//! use. A change elsewhere reaches a settled replica at its next refresh, within the calm
//! period.
//!
//! The bursts are divided differently, because a bucket must hold a request to admit it
//! at all: each replica reports the least part `q_r` of the bursts that holds the largest
//! request it was asked in its last two periods, gets it, and the rest of the bursts in
//! proportion to its rate. The replicas whose parts fit together hold leases, the
//! heaviest first; a replica asked a request its part does not hold waits for its next
//! refreshes, which grow its part as the others' shrink. A burst split in proportion to
//! rates alone would give a small replica a bucket that never fills to one request, and
//! one sized for the largest request a replica may ever be asked
//! ([`AccountLeases::largest_cost`]) lets a burst of one such request go to one replica
//! at a time.
//!
//! The caller is granted its allotment, but never more than the others leave: an other
//! counts the larger of what it was granted and what it said it may still be using. A
//! replica granted less than it holds keeps what it holds until its next report is sent,
//! which says it uses only the smaller part (it *confirms* it) and from which it does:
//! Redis counts the larger part until then whatever the replica does, so a part given back
//! is used by its giver until it is free for another, rather than by nobody. The
//! reply also carries the members' benches, the caller's part of each tenant's demand,
//! which the fair queue uses as its tenants' weights, and each band's part of what the
//! caller holds, which its fair queue keeps as the band's minimum share
//! ([`FleetShares::band_shares`](tower_limits_core::FleetShares::band_shares)): a later
//! band whose requests land beside the first band's gets the part the fleet gave it
//! there, not its configured share of everything the replica holds.
//!
//! With [`replaceable_limits`](super::RedisAccountsBuilder::replaceable_limits), each
//! reply also carries every member's limits as the fleet holds them; a bucket whose limit
//! changed keeps the units it holds, up to its new burst, and refills at its new rate.
//!
//! A new fleet's bursts are full, as a new per-request store's are: the part of the
//! bursts no lease holds as tokens is kept in Redis and handed out as tokens with the
//! growth of the parts that take it. A burst part that shrinks drops the tokens above its
//! new capacity when the report that confirms it is sent, and gives them back with that
//! report: the first replica of a new fleet takes everything, gives most of it
//! back moments later, and the bursts pass to the replicas that need them rather than
//! being lost.
//!
//! # Bounds
//!
//! Over every window of length `W`, the fleet charges a member's limit at most
//! `B + W·A/P` units: its own bound, with no excess.
//!
//! - The rate fractions Redis counts sum to at most the whole at every instant, and so do
//!   the burst fractions: a replica's entry counts the larger of its grant and what it
//!   reports until it confirms the smaller one, and until its lease expires. A replica
//!   holds at most the larger of the two: it takes a smaller grant from the instant it
//!   sends the report that confirms it, before Redis reads that report. So the rates the
//!   replicas refill at sum to at most `A`, and their buckets' capacities to at most `B`.
//! - A replica stops using a lease at its local expiry, counted from a `now` taken before
//!   its call was sent, so never after Redis stops counting it.
//! - Tokens come only from refills and from a new fleet's unspent bursts. A bucket whose
//!   burst grows keeps its tokens (a new lease starts empty, but for the unspent bursts);
//!   one that shrinks drops what is above its new capacity as the report that confirms
//!   its smaller part is sent, and gives it back (the least part over the limits) in that
//!   report, whose counted part shrinks by at least as much. The unspent part stays at
//!   most the part of the bursts nobody is counted for (each grant takes from it no more
//!   than its counted part grew), so the tokens held and the unspent bursts never sum to
//!   more than the bursts: the fleet is one bucket that started full. A report whose
//!   answer is lost may have been applied: its tokens are not given back twice.
//!
//! A replaced limit holds for a replica from its next refresh (the replica that lowered
//! it, at once): until then it refills at the limit it knew, so for up to one period
//! between refreshes (the calm period while the fleet is settled) and the call after a
//! lowering the fleet may charge the old rate.
//!
//! As in memory, a settle that charges more than a grant took is a debt of the bucket
//! that granted it, repaid by its refill; the fleet may exceed the bound by the overrun
//! of each replica's last grant.
//!
//! A Redis that lost its state (see the module's "Restarted empty") forgets the fleet's
//! leases: for one lifetime after a replica finds that out, no replica is granted more
//! than it says it may still be using, so the fractions still sum to at most the whole.
//!
//! # Known limits
//!
//! What the scheme does not handle:
//!
//! - **Holders whose parts do not fit.** When the replicas' least parts sum to more than
//!   the bursts, the lightest hold no lease at all, and with equal weights the order is
//!   fixed, so the same replicas wait for as long as the others stay busy. Leases want
//!   bursts that hold each replica's largest request at once.
//! - **Loss seen first by a new replica.** A Redis that lost its state is recognised by a
//!   replica that reached it before. If a replica that just started is the first to
//!   call, the others' leases are not counted for up to a lifetime, and the bursts are
//!   handed out full once more. The same goes for a
//!   Redis rolled back to an older snapshot, or failed over to a replica that lags: its
//!   epoch is there, and the leases it lost are not counted until their holders refresh.
//! - **Fallback while others still hold leases.** When Redis is away, a replica whose
//!   lease ended falls back to its local share of each account, while another's lease
//!   may still run for up to about one period between refreshes more (the calm period
//!   while the fleet was settled).
//! - **A stale call.** A refresh that a client retries after a newer one has been applied
//!   overwrites the newer entry. Entries expire by the server's wall clock, so a clock
//!   step forward ends them early.
//!
//! # What it costs
//!
//! One call per busy replica per refresh period while capacity moves, one per calm period
//! while the fleet is settled, whatever the requests (carrying the replica's capacity
//! shares too, with [`RedisAccountsBuilder::carry_shares`](crate::RedisAccountsBuilder::carry_shares)),
//! and one more in three cases. A
//! replica short of its part while another holds more than its own (told to give some
//! back, or to be told at its next refresh) asks again just after that one's next
//! refresh or confirmation. A replica told to give a large part back (a tenth of the
//! whole or more) while others wait for capacity confirms at once, so the part is free
//! one call later rather than one period. A replica that took a large part looks again a
//! tenth of a period on: the first replica to refresh in a new fleet takes the whole,
//! and the others, arriving moments later, would otherwise wait a period for it to give
//! their parts back, then a second for their own turn; and one allotted a large part but
//! granted nothing looks again a tenth of a period on at the latest, since a holder may
//! give its part back before the refresh it was told of. None while it is idle. A
//! call reads every live replica's entry, so its cost grows with the fleet. The
//! background task refreshes at the instant an answer asked for, whichever call that
//! answer came to. A first request on a replica without a lease waits for one call; a
//! replica whose lease is spent refuses locally with the exact wait of its bucket, but
//! never longer than until its next refresh is answered (its part may grow then, and
//! the request decides again, locally), or, granted nothing, until that refresh.
//!
//! # Failure
//!
//! While Redis is slow or away a replica decides from its lease until it expires (the
//! lifetime, 1 s by default), then the failure policy applies: the pool's local sets
//! (fallback), or refusals (fail closed).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tower_limits_core::Instant;

mod limit;
mod report;
mod settings;

use limit::per_refresh;
pub(super) use limit::{LeasedLimit, least_part};
pub(super) use report::{Report, Sent};
pub use settings::AccountLeases;

/// The whole pool, in the millionths leases are counted in.
pub(crate) const WHOLE: u64 = 1_000_000;

/// How far a replica's weight moves toward the one its refresh reports: its tenants'
/// requests waiting swing from one refresh to the next, and every part of a rate that
/// moves between replicas is idle from the giver's confirmation to the taker's refresh.
pub(super) const SMOOTH: f64 = 0.3;

/// A rate part within this of the one a replica holds (millionths) is left as it is.
pub(super) const DEAD: u64 = WHOLE / 100;

/// A fleet whose every replica holds its allotment within this (millionths) is settled:
/// its refreshes space out. The allotments swing by a few hundredths from one refresh to
/// the next with the requests each replica has waiting; moving such a part costs a call
/// and mends nothing.
pub(super) const SETTLE: u64 = WHOLE / 25;

/// A part given back that is at least this large, while other replicas wait for
/// capacity, is confirmed at once (the giver asks again right after its answer) rather
/// than at its next period.
pub(super) const LARGE: u64 = WHOLE / 10;

/// How soon after the refresh that told it to give a large part back a replica has
/// confirmed it: when the replicas short of their parts ask again (µs).
pub(super) const CONFIRM_US: u64 = 5_000;

/// How long after the instant of a refresh its answer is taken to have come, for a
/// request refused meanwhile to decide again (ns).
const ANSWERED: u64 = 2_000_000;

/// What the local lease decided.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Decision {
    /// The member charged.
    Granted(usize),
    /// Refused; the wait until a member could grant.
    Refused(Duration),
    /// No lease in force: ask Redis.
    NoLease,
    /// No lease in force, and the last refresh failed moments ago: the failure policy.
    Down,
}

/// This replica's lease and its buckets.
pub(super) struct Leases {
    pub(super) settings: AccountLeases,
    state: Mutex<State>,
    /// One refresh at a time, so that answers apply in the order they were asked.
    pub(super) refreshing: tokio::sync::Mutex<()>,
    /// The latest `now` an acquisition or a refresh was given, ns.
    pub(super) latest: AtomicU64,
    /// When Redis asked for an early refresh, on tokio's clock, and how long after the
    /// answer it asked.
    early: Mutex<Option<(tokio::time::Instant, Duration)>>,
    /// Woken when Redis asks for an early refresh: the background task, waiting for its
    /// period, waits for that instant instead.
    pub(super) rearm: std::sync::Arc<tokio::sync::Notify>,
}

struct State {
    /// Per member, its limits (replaced when the fleet's limits are), and the requests
    /// the members allow in one refresh period, together.
    limits: Vec<Vec<LeasedLimit>>,
    per_refresh: f64,
    /// The fraction of every rate the lease holds, and of every burst.
    rate: u64,
    burst: u64,
    /// The parts the last answer granted: a part granted smaller than the one held stays
    /// in force until the next report is sent (Redis counts the larger until that report
    /// confirms the smaller), then the lease shrinks to it.
    granted: (u64, u64),
    expires: Instant,
    /// A refresh's answer, applied by the next acquisition (whose `now` is after it): the
    /// rate and burst parts, their expiry, the instant the answer came, before which
    /// the new parts refill nothing, and the part of the bursts given as tokens.
    pending: Option<(u64, u64, Instant, Instant, u64)>,
    /// Per member, per limit: tokens in units times the unit's interval times [`WHOLE`].
    tokens: Vec<Vec<i128>>,
    /// Tokens a shrunk burst part dropped, as a part of the bursts (the least over the
    /// limits), for the next report to give back to Redis.
    dropped: u64,
    at: Instant,
    /// Requests admitted and refused since the last report.
    admitted: u64,
    refused: u64,
    /// The largest cost asked since the last report, and the one that report carried: the
    /// burst part a lease must hold is sized by the larger.
    wanted: u64,
    wanted_before: u64,
    /// Granted nothing: refused without asking until then.
    denied_until: Instant,
    /// Until when the replica counts as busy (a lifetime after its last acquisition).
    busy_until: Instant,
    /// A refresh failed: acquisitions without a lease go to the failure policy until then,
    /// with no call of their own.
    down_until: Instant,
    /// When the latest `now` was given, on tokio's clock (for the background task).
    latest_at: tokio::time::Instant,
    /// When the last report Redis heard was sent: the admissions since count over the
    /// time since.
    reported_at: Instant,
    /// When the background task refreshes next, however still the replica's demand, and
    /// what the last report Redis heard said of that demand.
    due: Instant,
    period: Duration,
    sent: Option<Sent>,
    /// When the next refresh's answer may change the lease: the period's refresh, or the
    /// early one Redis asked for.
    next: Instant,
}

impl Leases {
    pub(super) fn new(settings: AccountLeases, limits: Vec<Vec<LeasedLimit>>) -> Leases {
        let per_refresh = per_refresh(&settings, &limits);
        let tokens = limits.iter().map(|m| vec![0; m.len()]).collect();
        Leases {
            settings,
            state: Mutex::new(State {
                limits,
                per_refresh,
                rate: 0,
                burst: 0,
                granted: (0, 0),
                expires: Instant::ZERO,
                pending: None,
                tokens,
                dropped: 0,
                at: Instant::ZERO,
                admitted: 0,
                refused: 0,
                wanted: 0,
                wanted_before: 0,
                denied_until: Instant::ZERO,
                busy_until: Instant::ZERO,
                down_until: Instant::ZERO,
                latest_at: tokio::time::Instant::now(),
                reported_at: Instant::ZERO,
                due: Instant::ZERO,
                period: settings.refresh(),
                sent: None,
                next: Instant::ZERO,
            }),
            refreshing: tokio::sync::Mutex::new(()),
            latest: AtomicU64::new(0),
            early: Mutex::new(None),
            rearm: std::sync::Arc::new(tokio::sync::Notify::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Brings the buckets to `now`: refilled at the fraction until the lease expires; an
    /// expired lease is dropped (debts are kept).
    fn advance(&self, st: &mut State, now: Instant) {
        if now > st.at {
            let until = if now < st.expires { now } else { st.expires.max(st.at) };
            let elapsed = i128::from(until.nanos_since(st.at));
            let (rate, burst) = (st.rate, st.burst);
            for (member, tokens) in st.limits.iter().zip(&mut st.tokens) {
                for (l, t) in member.iter().zip(tokens.iter_mut()) {
                    *t = (*t + elapsed * LeasedLimit::refill(rate)).min(l.capacity(burst));
                }
            }
            st.at = now;
        }
        if now >= st.expires && st.rate > 0 {
            st.rate = 0;
            st.burst = 0;
            for t in st.tokens.iter_mut().flatten() {
                *t = (*t).min(0);
            }
        }
    }

    /// Applies the last refresh's answer: a part that grows is in force at once, keeping
    /// the burst's tokens and adding the `gift`; a part that shrinks stays as it is until
    /// the next report is sent ([`shrink`](Self::shrink)). Redis counts the larger part
    /// until that report confirms the smaller, so a part given back is used by its
    /// holder until then rather than by nobody.
    fn take_pending(&self, st: &mut State, now: Instant) {
        self.advance(st, now);
        if let Some((rate, burst, expires, from, gift)) = st.pending.take() {
            if now < expires {
                // (An expired lease holds nothing: `advance` dropped it.)
                st.granted = (rate, burst);
                (st.rate, st.burst, st.expires) = (st.rate.max(rate), st.burst.max(burst), expires);
                Self::fill(st, gift);
                // The new parts refill from when the answer came, not from when it was
                // asked: another replica may have used them until then.
                st.at = st.at.max(from);
            }
            self.advance(st, now);
        }
    }

    /// Adds `gift` (a part of the bursts) to every bucket and drops what is above its
    /// capacity, for the next report to give back to Redis (the least part of the bursts
    /// dropped over the limits), for a part that grows to take.
    fn fill(st: &mut State, gift: u64) {
        let mut dropped = u64::MAX;
        for (member, tokens) in st.limits.iter().zip(&mut st.tokens) {
            for (l, t) in member.iter().zip(tokens.iter_mut()) {
                let full = *t + l.capacity(gift);
                *t = full.min(l.capacity(st.burst));
                let whole = l.capacity(WHOLE).max(1);
                let part = (full - *t).max(0) * i128::from(WHOLE) / whole;
                dropped = dropped.min(u64::try_from(part).unwrap_or(0));
            }
        }
        if dropped != u64::MAX {
            st.dropped = st.dropped.saturating_add(dropped).min(WHOLE);
        }
    }

    /// A report is being sent at `now`: the parts the last answer granted smaller than
    /// those held come in force, and the tokens above a shrunk burst part are dropped.
    /// The part of the bursts dropped since the last report sent, which this one gives
    /// back (once: a report whose answer is lost may have been applied).
    pub(super) fn shrink(&self, now: Instant) -> u64 {
        let mut guard = self.lock();
        let st = &mut *guard;
        self.take_pending(st, now);
        if st.rate > 0 && (st.rate, st.burst) != st.granted {
            (st.rate, st.burst) = st.granted;
            Self::fill(st, 0);
        }
        std::mem::take(&mut st.dropped)
    }

    /// Decides a request of `cost` at `now` from the lease, skipping the members benched
    /// past `now` (`benched`, ns of the caller's clock).
    pub(super) fn decide(&self, cost: u64, benched: &[u64], now: Instant) -> Decision {
        let mut guard = self.lock();
        let st = &mut *guard;
        if self.latest.fetch_max(now.as_nanos(), Ordering::Relaxed) < now.as_nanos() {
            st.latest_at = tokio::time::Instant::now();
        }
        self.take_pending(st, now);
        st.busy_until = now + self.settings.lasts();
        st.wanted = st.wanted.max(cost);
        if st.rate == 0 {
            if now < st.denied_until {
                st.refused += 1;
                return Decision::Refused(Duration::from_nanos(st.denied_until.nanos_since(now)));
            }
            if now < st.down_until {
                return Decision::Down;
            }
            // Wanted and not held: the refresh that follows asks for all it may need.
            st.refused += 1;
            return Decision::NoLease;
        }
        let mut best: Option<(usize, f64)> = None;
        let mut wait = u64::MAX;
        let refresh_ns = u64::try_from(self.settings.refresh().as_nanos()).unwrap_or(u64::MAX);
        for (m, member) in st.limits.iter().enumerate() {
            let bench = benched.get(m).copied().unwrap_or(0);
            if bench > now.as_nanos() {
                wait = wait.min(bench - now.as_nanos());
                continue;
            }
            // The member's headroom after the request: the smallest remaining part of a
            // limit's capacity.
            let (mut headroom, mut short) = (f64::INFINITY, 0_u64);
            let mut fits = true;
            for (l, &t) in member.iter().zip(&st.tokens[m]) {
                let need = l.need(cost);
                let capacity = l.capacity(st.burst);
                if need > capacity {
                    fits = false;
                } else if t < need {
                    let refill = LeasedLimit::refill(st.rate).max(1);
                    let ns = u64::try_from((need - t + refill - 1) / refill).unwrap_or(u64::MAX);
                    short = short.max(ns);
                } else {
                    headroom = headroom.min((t - need) as f64 / capacity.max(1) as f64);
                }
            }
            if !fits {
                // Too large for this fraction: the next lease may hold it.
                wait = wait.min(refresh_ns);
            } else if short > 0 {
                wait = wait.min(short);
            } else if best.is_none_or(|(_, h)| headroom > h) {
                best = Some((m, headroom));
            }
        }
        match best {
            Some((m, _)) => {
                for (l, t) in st.limits[m].iter().zip(st.tokens[m].iter_mut()) {
                    *t -= l.need(cost);
                }
                st.admitted += 1;
                Decision::Granted(m)
            }
            None => {
                st.refused += 1;
                // No longer than until the next refresh's answer, which may change the
                // lease (a part that grew refills sooner): the request decides again
                // then, locally. (A wait computed at a sliver of the rate would outlast a
                // part that grows meanwhile, and the requests would sleep through it.) A
                // refresh overdue is looked for a quarter of a period on.
                let next = if st.next == Instant::ZERO {
                    u64::MAX
                } else if st.next > now {
                    st.next.nanos_since(now).saturating_add(ANSWERED)
                } else {
                    refresh_ns / 4
                };
                Decision::Refused(Duration::from_nanos(wait.min(next).min(refresh_ns.max(1).saturating_mul(10))))
            }
        }
    }

    /// Charges `requests` and `cost` more (or refunds them, negative) to `member`'s
    /// bucket: a settle or a cancel.
    pub(super) fn adjust(&self, member: usize, requests: i64, cost: i64) {
        let mut guard = self.lock();
        let st = &mut *guard;
        let burst = st.burst;
        let (Some(limits), Some(tokens)) = (st.limits.get(member), st.tokens.get_mut(member)) else { return };
        // (Bounded so that no product overflows: a charge beyond a day's worth of a burst
        // is a debt as final as the bound.)
        let most = 1_i128 << 40;
        for (l, t) in limits.iter().zip(tokens.iter_mut()) {
            let units = i128::from(if l.cost { cost } else { requests }).clamp(-most, most);
            *t = (*t - units * l.unit()).clamp(-most * l.unit(), l.capacity(burst));
        }
    }

    /// What the upstream said is left of `member`'s limits: this replica's fraction of it
    /// bounds its bucket.
    pub(super) fn correct(&self, member: usize, requests: Option<u64>, tokens: Option<u64>) {
        let mut guard = self.lock();
        let st = &mut *guard;
        let fraction = i128::from(st.rate);
        let (Some(limits), Some(buckets)) = (st.limits.get(member), st.tokens.get_mut(member)) else { return };
        for (l, t) in limits.iter().zip(buckets.iter_mut()) {
            if let Some(left) = if l.cost { tokens } else { requests } {
                let left = i128::from(left.min(l.burst));
                *t = (*t).min(left * l.unit() * fraction / i128::from(WHOLE));
            }
        }
    }

    /// What a refresh reports at `now`: the rate and burst fractions this replica may still
    /// be using, the most rate it could use (`backlog`: requests are waiting for the
    /// accounts) and the least burst part that holds its requests, and the counts it
    /// stands for, to [`reported`](Self::reported) once Redis has them.
    pub(super) fn report(&self, now: Instant, backlog: bool) -> Report {
        let mut st = self.lock();
        // The last answer came before this refresh began: it is in force now, even for a
        // replica that made no acquisition since.
        self.take_pending(&mut st, now);
        // (What it may use once this report is sent: the parts granted last, which a part
        // held larger shrinks to then.)
        let using = if now < st.expires && st.rate > 0 { st.granted } else { (0, 0) };
        let cap = if st.refused > 0 || backlog {
            WHOLE
        } else if st.admitted == 0 {
            0
        } else {
            // (Admissions since the last report, over the periods since: a settled
            // fleet reports every few periods, and an early refresh after a fraction of
            // one, whose admissions would otherwise read as a fraction of the rate.)
            let refresh_ns = self.settings.refresh().as_nanos() as f64;
            let periods = if st.reported_at == Instant::ZERO {
                1.0
            } else {
                (now.nanos_since(st.reported_at) as f64 / refresh_ns.max(1.0)).clamp(0.25, 64.0)
            };
            let part = 2.0 * st.admitted as f64 / (st.per_refresh.max(1.0) * periods);
            ((part * WHOLE as f64) as u64).clamp(WHOLE / 64, WHOLE)
        };
        let wanted = st.wanted.max(st.wanted_before).max(1);
        let least = least_part(&st.limits, wanted);
        Report { using, cap, least, counts: (st.admitted, st.refused, st.wanted) }
    }

    /// The fleet's limits as Redis holds them (replaced ones included), per member and
    /// limit its interval and tolerance (ns), taken at `now`: a limit that changed keeps
    /// the units its bucket holds, up to its new capacity, and refills at its new rate.
    pub(super) fn take_limits(&self, current: &[(u64, u64)], now: Instant) {
        let mut guard = self.lock();
        let st = &mut *guard;
        let mut given = current.iter();
        let mut changed = false;
        self.advance(st, now);
        let burst = st.burst;
        for (member, tokens) in st.limits.iter_mut().zip(&mut st.tokens) {
            for (l, t) in member.iter_mut().zip(tokens.iter_mut()) {
                let Some(&limit) = given.next() else { break };
                changed |= l.replace(t, limit, burst);
            }
        }
        if changed {
            st.per_refresh = per_refresh(&self.settings, &st.limits);
        }
    }

    /// This replica lowered limit `place` of `member` to `limit` (interval and tolerance,
    /// ns) at `now`: its lease decides with it at once rather than from its next refresh
    /// (lowering what a replica admits never breaks a bound; a raise waits for Redis, which
    /// takes a replacement only if it moves the fleet's limit the same way).
    pub(super) fn lower(&self, member: usize, place: usize, limit: (u64, u64), now: Instant) {
        let mut guard = self.lock();
        let st = &mut *guard;
        self.take_pending(st, now);
        let burst = st.burst;
        let (Some(l), Some(t)) = (
            st.limits.get_mut(member).and_then(|m| m.get_mut(place)),
            st.tokens.get_mut(member).and_then(|m| m.get_mut(place)),
        ) else {
            return;
        };
        if limit.0 > l.interval && l.replace(t, limit, burst) {
            st.per_refresh = per_refresh(&self.settings, &st.limits);
        }
    }

    /// Whether the background task should refresh at `now`: the period Redis gave has
    /// passed, or the replica's demand (`sent`, holding `report`) moved since the last
    /// report Redis heard.
    pub(super) fn due(&self, now: Instant, sent: &Sent, report: &Report) -> bool {
        let st = self.lock();
        // (Half a period early: the background task ticks every period, and the next
        // tick may come a hair before the instant the last refresh named.)
        now + self.settings.refresh() / 2 >= st.due
            || st.sent.as_ref().is_none_or(|before| before.moved(sent, report.using.0, report.cap))
    }

    /// Redis heard a report sent at `now` saying `sent`, and gave the period until the
    /// next refresh (`None`: the answer was lost, the refresh period) and, with `soon`,
    /// asked for an early one: a request refused meanwhile waits no longer than either.
    pub(super) fn heard(&self, now: Instant, sent: Sent, period: Option<Duration>, soon: Option<Duration>) {
        let mut st = self.lock();
        st.period = period.unwrap_or(self.settings.refresh());
        st.due = now + st.period;
        st.next = now + soon.map_or(st.period, |soon| soon.min(st.period));
        st.sent = Some(sent);
    }

    /// The period until the next refresh that the last answer gave (tests).
    #[cfg(feature = "test-support")]
    pub(super) fn period(&self) -> Duration {
        self.lock().period
    }

    /// Redis heard the counts of a report sent at `now`: the next one starts after them.
    pub(super) fn reported(&self, (admitted, refused, wanted): (u64, u64, u64), now: Instant) {
        let mut st = self.lock();
        st.reported_at = st.reported_at.max(now);
        st.admitted = st.admitted.saturating_sub(admitted);
        st.refused = st.refused.saturating_sub(refused);
        st.wanted_before = wanted;
        if st.wanted <= wanted {
            st.wanted = 0;
        }
    }

    /// Takes a refresh's answer, asked at `now` and come at `from`: parts of every `rate`
    /// and `burst` until `expires`, and the part `gift` of the bursts as tokens; granted
    /// nothing, the replica refuses without asking until its next refresh (the early one
    /// Redis asked for, if sooner).
    pub(super) fn granted(&self, (rate, burst, gift): (u64, u64, u64), expires: Instant, from: Instant, now: Instant) {
        let mut st = self.lock();
        st.pending = Some((rate, burst, expires, from, gift));
        if rate == 0 {
            // Until the next refresh: the period's, or the early one Redis asked for.
            let early = self.asked_again().map_or(self.settings.refresh(), |(_, after)| after);
            st.denied_until = now + early.min(self.settings.refresh());
        }
    }

    /// Redis asks for the next refresh `after` this long (`None`: at the next period).
    pub(super) fn ask_again(&self, after: Option<Duration>) {
        *self.early.lock().unwrap_or_else(PoisonError::into_inner) =
            after.map(|d| (tokio::time::Instant::now() + d, d));
        if after.is_some() {
            self.rearm.notify_one();
        }
    }

    /// When the background task should refresh before the next period, if Redis asked,
    /// and how long after the answer it asked.
    pub(super) fn asked_again(&self) -> Option<(tokio::time::Instant, Duration)> {
        *self.early.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A refresh at `now` failed: acquisitions without a lease go to the failure policy
    /// for a refresh period, without a call each.
    pub(super) fn failed(&self, now: Instant) {
        let mut st = self.lock();
        st.down_until = now + self.settings.refresh();
        st.next = now + self.settings.refresh();
    }

    /// Whether a lease is in force at `now`, or an answer waits to be applied: a request
    /// without one need not ask again.
    pub(super) fn in_force(&self, now: Instant) -> bool {
        let st = self.lock();
        (st.rate > 0 && now < st.expires) || st.pending.is_some_and(|(r, _, e, _, _)| r > 0 && now < e)
    }

    /// The caller's clock, estimated from the latest `now` it gave and the time since, on
    /// tokio's clock: never ahead of it, since that `now` was read before it was given.
    pub(super) fn estimated_now(&self) -> Instant {
        let st = self.lock();
        let elapsed = u64::try_from(st.latest_at.elapsed().as_nanos()).unwrap_or(u64::MAX);
        Instant::from_nanos(self.latest.load(Ordering::Relaxed).saturating_add(elapsed))
    }

    /// Whether the replica had no acquisition within a lifetime and holds no lease: its
    /// refreshes can stop.
    pub(super) fn idle(&self, now: Instant) -> bool {
        let st = self.lock();
        now >= st.busy_until && (st.rate == 0 || now >= st.expires) && st.pending.is_none_or(|(r, _, _, _, _)| r == 0)
    }

    /// The fractions of every rate and every burst in force at `now` (tests and stats).
    pub(super) fn fractions(&self, now: Instant) -> (u64, u64) {
        let mut st = self.lock();
        self.take_pending(&mut st, now);
        (st.rate, st.burst)
    }
}

#[cfg(test)]
mod tests;
