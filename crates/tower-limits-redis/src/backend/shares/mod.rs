//! Capacity shares: each replica decides its rate limits, semaphores and windows from a
//! share it holds, and asks Redis once per refresh for all of them, not once per request.
//!
//! # The scheme
//!
//! A rate limit of `A` units per period `P` with burst `B`, for one scope (the whole fleet
//! for a global limit, one tenant for a keyed one), is split in Redis into the *shares*
//! the replicas hold and a *pool* that none holds. A share is a rate `a_r` with a burst
//! `b_r = ⌊B·a_r/A⌋`, valid until it expires; the replica runs it as a token bucket of its
//! own and admits from it without a round trip. The pool is a token bucket refilled at
//! the rate no replica holds, `A − Σ a_r`, up to the burst no replica holds,
//! `B − Σ b_r`; a replica without a share for a scope takes from the pool, one round
//! trip per request (the per-request path, for cold keys).
//!
//! Every refresh period (100 ms by default) a replica sends one call carrying, for every
//! scope it is busy with, the share it may be using, the demand it saw (units per
//! period, with a quarter of headroom) and the tokens it gives back. The script allots
//! each scope's rate max-min fairly by the live replicas' demands, and grants the caller
//! `min(its allotment, A − Σ others)`: a replica whose allotment shrank gives up the
//! difference at its own next refresh, and only then can another take it. A share too
//! small to hold one unit of burst stays in the pool, and a rate whose whole burst is
//! below `min_burst` (8 units) is never split: its scopes take from the pool, one round
//! trip per request, as a cold scope does. A pool that refused a scope, or that a grant
//! left without a unit, answers with the exact time it holds a unit again, and until
//! then the replica refuses that scope locally. A thin rate's pool books what it would
//! refuse and refills within a lifetime for the replica that asked, which takes it with
//! no call once due (see Bounds below): a client retrying a thin rate across replicas
//! costs about a call per unit admitted. Demand below `hot_after` requests
//! a refresh (4) asks for no share: the scope stays with the pool; a scope that holds a
//! share keeps asking while any request comes, and gives its share back after a period
//! without one. A scope new to the replica that turns hot does not wait for the period's
//! end: the refresh loop sends it alone, a tenth of a period after the last call at the
//! earliest, so a tenant arriving with a burst costs a few pool calls, not a period of
//! them (its demand is still counted over a whole period, so a burst never claims more
//! than its requests: measured over the time since it began, a burst would claim a
//! tenant's whole rate and leave the pool nothing for the tenant's requests on other
//! replicas until the next refresh). Requests a semaphore of the set refuses are not
//! counted as demand of its rates. A replica whose share is spent asks the pool before
//! refusing; refused there, its share alone decides until the pool could have a token.
//!
//! # Bounds
//!
//! Over every window of length `W`, the fleet admits at most `B + W·A/P` units of a
//! scope: the bound of the limit itself, with no excess. Tokens are only created at the
//! replicas' rates and the pool's, which sum to at most `A`, and held in buckets whose
//! capacities sum to at most `B`:
//!
//! - Redis counts, for each replica, the larger of the share it granted last and the one
//!   the replica says it may still be using, until the replica confirms the smaller one
//!   at its next refresh or the share expires. So `Σ a_r ≤ A` and `Σ b_r ≤ B` hold for
//!   every share a replica may be using, even while a reply is in flight or lost.
//! - A replica stops using a share at its local expiry, counted from the instant before
//!   its request was sent, so never after Redis stops counting it (clocks need only run
//!   at the same rate over one lifetime, not agree).
//! - Tokens move between the pool and a replica only by a grant (`gift`, taken from the
//!   pool) or a give-back (taken from the replica first): when a share shrinks, the tokens
//!   above its new burst leave its bucket at once and reach the pool at the next refresh,
//!   where the pool's own cap (the burst no replica holds) bounds them; when a share
//!   expires unrenewed, its tokens are dropped. A new share starts with what the pool
//!   gives it, not with a full burst.
//! - A share that expired counts as held until Redis removes it, so the pool never
//!   refills faster than the rate nobody holds.
//!
//! Settles refund or charge the bucket that granted: a charge beyond what a grant took
//! is a debt of its share, repaid by the share's refill before it grants again, and
//! handed to the pool when the share ends. As in memory, where the last grant's overrun
//! may exceed the bound, the fleet may exceed it by the overrun of each share's last
//! grant.
//!
//! With [`Shares::burst_excess`], the bursts the shares split sum to `B` plus that
//! percentage of it, and the bound is that larger burst plus the rate: an excess the user
//! chooses, zero by default.
//!
//! Bookings keep the bound. A thin rate's pool (never split, so no share takes its rate)
//! books units for a replica by paying them at once, a debt its refill repays exactly by
//! the time they are due, and records them as a share of no rate whose burst is the
//! units until they are used or lost (a refresh period after they are due, or the wait if
//! longer): the bursts, bookings included, still sum to `B` at most. A replica takes them
//! no earlier than Redis made them due (counted from the answer) and no later than Redis
//! holds them (counted from before the call). No share grows while its pool is in debt,
//! so the pool's refill rate never falls before a booking is due.
//!
//! The one documented margin: a Redis that restarts empty forgets every share, and
//! answers as a fresh limit while replicas still use theirs, so for one lifetime the
//! fleet may admit up to twice the limit.
//!
//! # What it costs
//!
//! Redis work grows with the replicas and the scopes they are busy with, not with
//! requests: one call per replica per refresh (one per Cluster slot on a cluster),
//! carrying every scope, and of every backend of the replica built into one
//! [`ShareGroup`]. A request admitted from a share takes a lock and a few
//! integer operations per limit; one refused by an exhausted share is refused locally,
//! with the exact wait of the share, and counts as demand.
//!
//! # Failure
//!
//! While Redis is slow or away, a replica keeps deciding from its shares until they
//! expire (the lifetime, 1 s by default; a window's block until it is spent, about two
//! periods of the replica's demand); scopes without a share, and then every scope,
//! follow the failure policy. Refreshes are not retried: the next one carries the same
//! scopes.
//!
//! # Semaphores
//!
//! A semaphore's shares are permits, allotted by the same script (a burst of 0 marks
//! them): a replica admits while its requests in flight fit its share and releases
//! locally. It reports as the share it may be using the larger of its share and its
//! permits held, so a share shrinks in Redis only as its permits come back: the fleet
//! never holds more than the capacity. Its demand, and its share when the permits allow,
//! is the most it held or was asked at once in the period, with no margin: a tenant at
//! its fleet-wide limit has exactly its permits, wherever its requests land, and the
//! permits no demand claims stay free. (A margin, or a part of the free permits handed
//! to the replicas already holding some, refused a tenant below its limit whose next
//! request landed on another replica.) A scope without a share fetches one with its
//! first request (one call) and finds those free permits, and a scope whose share is too
//! small for a request asks for more the same way, counting every request fetching with
//! it (its share follows the last period's peak, and the request may be the first of a
//! burst). Requests that find a fetch of their scope on its way wait for its answer
//! instead of sending their own, their permits counted in the next fetch's demand: a
//! herd arriving before a tenant's first share costs a call or two, not one each. A
//! fetch that grew the share but is still short asks once more (a request admitted
//! meanwhile may have taken the permit), one that did not grow it was told no permit is
//! free; when every permit it could have is held elsewhere it is refused, then
//! refused locally, with no call, for two refresh periods unless a refresh grows its share
//! meanwhile: its demand stands in its reports until then, so that the holders' next
//! allotments make room (a fetch after one period would find the same permits held: a
//! call a period for every starved replica). Redis counts a semaphore's share for the
//! backend's lease rather than the share's lifetime: the requests in flight outlive the
//! share they were admitted under, and a dead replica's permits come back within the
//! lease.
//!
//! # Windows
//!
//! A fixed or calendar window is leased in blocks of units. Its table counts the units
//! spent in the window and the block each replica holds; a replica spends from its block
//! locally, and each refresh reports the block it holds, its spending in the window all
//! told (a cumulative figure: a lost reply is never counted twice) and the block it
//! wants (two refresh periods of its demand, plus a quarter). The script grants from the
//! units nobody spent or holds, max-min fairly by demand once they run short, and asks a
//! block above its fair part back (counted as held until the replica reports it gone).
//! Spent plus held never exceeds the limit, so the fleet admits at most the limit in
//! every window. Each replica names its window by its own clock; a block of an earlier
//! window is worth nothing. A block that expires unrenewed counts as spent (its replica
//! may have spent all of it): a dead replica costs the window at most its block.
//!
//! # What is not shared
//!
//! Sliding windows: a set with one is refused when the backend is built.
//! Settling a grant charges or refunds its share (locally) or the pool (one background
//! call); a semaphore's holding does not change with the usage.

use std::time::Duration;

mod group;
mod remote;
mod table;

pub use group::ShareGroup;
pub(crate) use group::{Group, Ride};
pub(super) use table::{SharedGrant, Table};

/// The script of the share tables.
pub(crate) const SCRIPT: &str = include_str!("script.lua");

/// How a [`RedisBackend`](crate::RedisBackend) splits its rate limits, semaphores and
/// windows among replicas: capacity shares, leased from Redis and refreshed in the background, so
/// that a request admitted from a share makes no round trip. See
/// [`RedisBackendBuilder::shares`](crate::RedisBackendBuilder::shares) and the guide for
/// the scheme and its bounds.
///
/// ```
/// use std::time::Duration;
/// use tower_limits_redis::Shares;
///
/// let shares = Shares::new().refresh_every(Duration::from_millis(50)).lifetime(Duration::from_millis(500));
/// assert_eq!(shares.refresh(), Duration::from_millis(50));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct Shares {
    refresh: Duration,
    lifetime: Duration,
    max_scopes: usize,
    hot_after: u32,
    burst_excess: u32,
    min_burst: u64,
}

impl Default for Shares {
    fn default() -> Self {
        Self::new()
    }
}

impl Shares {
    /// Refreshed every 100 ms, living 1 s, at most 10,000 scopes tracked, a scope asking
    /// for a share after 4 requests in a refresh period, rates whose burst is below 8
    /// units never split.
    pub const fn new() -> Shares {
        Shares {
            refresh: Duration::from_millis(100),
            lifetime: Duration::from_secs(1),
            max_scopes: 10_000,
            hot_after: 4,
            burst_excess: 0,
            min_burst: 8,
        }
    }

    /// The smallest burst (in the limit's units, its excess included) a rate must have to
    /// be split into shares (default 8). A thinner one is decided per request from the
    /// pool, which then holds its whole burst: a burst of 2 split over replicas leaves
    /// each a share of 0 or 1, which paces the tenant at its share's rate while the
    /// limit has room (a free plan's 240 a minute with a burst of 2 served a third of
    /// what it allows). Semaphores are split whatever their size.
    ///
    /// ```
    /// use tower_limits_redis::Shares;
    ///
    /// assert_eq!(Shares::new().min_burst(32).least_burst(), 32);
    /// ```
    pub const fn min_burst(mut self, units: u64) -> Self {
        self.min_burst = units;
        self
    }

    /// The smallest burst a rate needs to be split (see [`Shares::min_burst`]).
    #[must_use]
    pub const fn least_burst(&self) -> u64 {
        self.min_burst
    }

    /// How often a replica reports its demand and renews its shares (default 100 ms):
    /// the Redis work of the fleet is one call per replica per period, and capacity
    /// moves between replicas within about two periods.
    pub const fn refresh_every(mut self, every: Duration) -> Self {
        self.refresh = every;
        self
    }

    /// How long a share lives without a refresh (default 1 s): how long a replica serves
    /// while Redis is away, and how long the share of a replica that died stays taken.
    /// At least two refresh periods plus the call timeout.
    pub const fn lifetime(mut self, lifetime: Duration) -> Self {
        self.lifetime = lifetime;
        self
    }

    /// The most scopes (limit and tenant) one replica tracks (default 10,000), which
    /// bounds its memory; a scope is forgotten two refresh periods after its last
    /// request, its share given back. Beyond the bound, a new scope's rate takes from the
    /// pool, and its semaphore refuses (it has no pool), until quiet scopes are
    /// forgotten.
    pub const fn max_scopes(mut self, scopes: usize) -> Self {
        self.max_scopes = scopes;
        self
    }

    /// How many requests in one refresh period make a scope ask for a share (default 4);
    /// below it, the scope takes from the pool, one round trip per request.
    pub const fn hot_after(mut self, requests: u32) -> Self {
        self.hot_after = requests;
        self
    }

    /// Lets the shares of a rate's burst sum to the burst plus `percent` percent of it
    /// (default 0). A burst split over many replicas leaves each a small one, which
    /// refuses locally while the fleet has room; with an excess, each holds more. The
    /// price is stated: over every window the fleet may admit up to `burst * percent /
    /// 100` more than the limit allows (`B * (1 + percent / 100) + W * rate` in all), and
    /// nothing more. Zero admits no excess. At most 1,000.
    ///
    /// ```
    /// use tower_limits_redis::Shares;
    ///
    /// // Bursts split over replicas may sum to twice the burst.
    /// let shares = Shares::new().burst_excess(100);
    /// assert_eq!(shares.excess_percent(), 100);
    /// ```
    pub const fn burst_excess(mut self, percent: u32) -> Self {
        self.burst_excess = percent;
        self
    }

    /// The burst excess allowed, in percent of each rate's burst.
    #[must_use]
    pub const fn excess_percent(&self) -> u32 {
        self.burst_excess
    }

    /// The refresh period.
    #[must_use]
    pub const fn refresh(&self) -> Duration {
        self.refresh
    }

    /// The lifetime of a share.
    #[must_use]
    pub const fn share_lifetime(&self) -> Duration {
        self.lifetime
    }

    pub(super) fn validate(&self, timeout: Duration) -> Result<(), crate::BuildError> {
        let invalid = |field, message: String| Err(crate::BuildError::Invalid { field, message });
        if self.refresh < Duration::from_millis(1) {
            return invalid("shares.refresh", format!("must be at least 1ms, got {:?}", self.refresh));
        }
        crate::periodic::check_lifetime("shares.lifetime", self.refresh, self.lifetime, timeout)?;
        if self.max_scopes == 0 {
            return invalid("shares.max_scopes", "must be at least 1".into());
        }
        if self.burst_excess > 1_000 {
            return invalid(
                "shares.burst_excess",
                format!("must be at most 1000 (percent), got {}", self.burst_excess),
            );
        }
        Ok(())
    }
}

/// A limit as the share tables count it: a rate of `amount` units per period with its
/// burst; with `permits`, a semaphore of `amount` permits (no period, no burst); with
/// `window`, a fixed or calendar window of `amount` units, leased in blocks (`period_us`
/// the fixed window's length, 0 for a calendar one).
#[derive(Debug, Clone, Copy)]
pub(super) struct ShareLimit {
    pub(super) amount: u64,
    pub(super) period_us: u64,
    pub(super) burst: u64,
    pub(super) permits: bool,
    pub(super) window: bool,
}

impl ShareLimit {
    fn period_ns(&self) -> i128 {
        i128::from(self.period_us) * 1000
    }
}
