//! A weighted-fair queue of tenants' requests: start-time fair queuing, sans IO.
//!
//! [`FairQueue`] holds requests that wait for shared capacity and decides, each time
//! capacity frees up, whose request goes next, so that tenants who keep asking share
//! the capacity in proportion to their weights, whatever their request sizes, and
//! nobody waits forever. It is a plain data structure: it knows nothing of time, locks
//! or wakers. A layer keeps it behind a mutex and drives it:
//!
//! - on arrival, [`FairQueue::enqueue`] (a full queue is refused at once with
//!   [`QueueFull`], which says whether the tenant's own queue or the whole queue was
//!   full: 429 or 503);
//! - while capacity is available, [`FairQueue::peek_next`] shows the request that is
//!   next and its cost, and [`FairQueue::pop_next`] dispatches it (when the head does
//!   not fit yet, the layer waits for capacity rather than skipping it: skipping would
//!   let small requests starve large ones);
//! - when a waiting future is polled again, [`FairQueue::get_mut`] reaches its item (to
//!   store a newer waker); when it is dropped, [`FairQueue::cancel`] with its [`Ticket`]
//!   takes the item back out.
//!
//! Wakers or senders live in the items; the layer wakes them after it releases the lock.
//!
//! # How it works
//!
//! **Virtual time and tags.** The queue keeps a global virtual time `V`, measured in
//! cost per unit of weight. Each tenant keeps a finish tag `F`: the virtual time at
//! which what it was last served "ends". When a request becomes the head of its
//! tenant's queue it gets a start tag `S = max(V, F)`. The next request dispatched is
//! the head with the smallest start tag among the backlogged tenants (those with
//! something queued), ties going to the request that arrived first. Dispatching it sets
//! `V = S` and `F = S + cost / weight`; when the tenant still has requests queued, its
//! next head starts at that `F`.
//!
//! **Start tags at the head, not on arrival.** A request gets its start tag only when it
//! reaches the head of its tenant's queue, so a tenant needs one tag, not one per
//! request; cancelling a request behind the head changes no tag at all; and a tenant's
//! tags depend only on what it was actually served, never on what it queued.
//!
//! **Where things live.** This file holds [`FairQueue`] and its choice of band;
//! `lane.rs` one band's operations (enqueue, dispatch, cancel, idle records);
//! `tenant.rs` a tenant's record and its tag arithmetic;
//! `heap.rs` the heaps of backlogged and idle tenants, whose entries move in place, so
//! dispatch and every change of a head cost O(log n) in the number of backlogged tenants;
//! `slab.rs` the requests, in one slab where each tenant's queue is a doubly linked list
//! (a request leaves from anywhere in O(1)), and the tickets into it; `config.rs` the
//! configuration and [`QueueFull`]; `stats.rs` the counters.
//!
//! **Exact integer tags.** Tags count units of 2⁻³² of a cost unit per unit of weight,
//! in `u128`; nothing is a float. `cost / weight` is rarely a whole number of units, so
//! each tenant keeps its tag exactly, as whole units plus a remainder over its weight,
//! and carries the remainder into its next division: after any run of dispatches its
//! tag is the exact sum of `cost / weight`, not a sum of rounded terms. Only
//! comparisons round (down, to whole units; `V` is a whole number of units), so no
//! rounding accumulates and every decision is the exact one up to 2⁻³². Each side of the
//! laws below is a fraction whose denominator divides `w_i·w_j`, so an error of a few
//! 2⁻³² cannot turn a law that holds for exact tags into one that fails, as long as
//! `w_i·w_j < 2³⁰` (any two weights below 32,768); beyond that, the laws hold within
//! 2⁻³⁰ cost units per unit of weight. A tenant whose weight changes while it carries a
//! remainder has it rounded up to the new weight, which delays it by less than 2⁻³².
//! Tags saturate rather than overflow; they last for 2⁹⁶ cost units per unit of weight.
//!
//! # Why it is fair
//!
//! `V` never goes back: every backlogged head starts at or after `V`, and `V` becomes
//! the smallest of them. A tenant that stays backlogged has contiguous tags (each head
//! starts where the previous request finished), and its head never starts more than its
//! last `cost / weight` after `V`. Over any interval in which tenants `i` and `j` are both
//! backlogged, the cost per weight each receives is therefore the advance of `V` give or
//! take one request, and (with `M` a tenant's largest cost and `w` its weight, which
//! the laws take to be constant):
//!
//! - **Bounded lag**: `|cost_i / w_i - cost_j / w_j| <= M_i / w_i + M_j / w_j`.
//! - **Proportional share**: tenants that stay backlogged receive cost in proportion to
//!   their weights; after `T` units of cost, tenant `i`'s share is within
//!   `max(M_i, w_i·ΣM / Σw) / T` of `w_i / Σw`.
//! - **No starvation**: a request that finds `A` of cost queued ahead of it in its
//!   tenant's queue is dispatched before any other tenant `j` receives more than
//!   `w_j·(A + M_i) / w_i + M_j` of cost.
//! - **No idle credit**: a tenant re-enters at `max(V, F)`, never before the current
//!   virtual time, so an idle period banks nothing: on its return it gets at most
//!   `M_i / w_i + M_j / w_j` ahead of a tenant `j` that stayed backlogged, however long
//!   it was away.
//! - **Work-conserving**: [`FairQueue::pop_next`] dispatches whenever anything is
//!   queued.
//!
//! # Priority bands
//!
//! A queue may have priority bands ([`FairQueueConfig::band`]): interactive traffic
//! ahead of batch jobs, without starving them. Each band is a queue of its own as
//! described above (its own virtual time, tenant records and busy periods), so tenants
//! share by weight inside a band, with every law above. A request goes into one band
//! ([`FairQueue::enqueue_in`]; [`FairQueue::enqueue`] uses the default band). Between
//! bands:
//!
//! - **Order.** The first band with requests dispatches, unless a later band is owed its
//!   minimum share.
//! - **Minimum share.** A band with `min_share_percent = m` keeps `m`% of the cost
//!   dispatched while it waits. Each waiting band keeps a deficit: `m`% of every cost
//!   dispatched from then on (its own included), less what it was served. Before the
//!   first band goes, the band owed the most (a deficit above zero; the first on a tie)
//!   goes instead. Serving the band owed most keeps every deficit within about one
//!   request: law 31 checks, on random traces of two to four bands, that a waiting band is
//!   never more than its largest request below its minimum share, and never ahead of an
//!   earlier band unless owed. Serving the first owed band instead broke that bound.
//! - **No banked share.** A band's deficit starts at zero when it starts waiting and is
//!   dropped when its last request leaves, so a band that was away owes and is owed
//!   nothing on its return.
//!
//! The minimum shares sum to at most 100%; a band with none goes only when the bands
//! before it have nothing queued. With one band (the default), the queue is exactly the
//! start-time fair queue above. Limits are per band for a tenant's queue, and over all
//! bands for the global one; each band keeps at most the global limit of idle records.
//!
//! # Idle tenants and memory
//!
//! A tenant's record (its weight, tags, queue and counters) must outlive its queue for a
//! while: a tenant that was just served a large request has `F > V`, and forgetting it
//! would let it start again at `V`, ahead of its turn. So an emptied tenant moves to a
//! second heap keyed by its finish tag, and its record is dropped as soon as `V`
//! reaches `F`: from then on it would start at `V` anyway, exactly as a tenant never
//! seen, so dropping it changes no decision. At most the global queue limit of such
//! idle records are kept; past that, the one whose `F` is closest to `V` is forgotten,
//! which lets that tenant start up to its last `cost / weight` early. The lag, share
//! and idle credit bounds still hold (they concern backlogged tenants, and a forgotten
//! tenant still starts at `V`); each such eviction can add one request of that tenant
//! to the starvation bound of the requests waiting meanwhile, and is counted in
//! [`FairQueueStats::evicted_idle`]. Together with the queue limits, the queue never
//! holds more than `global_queue_limit` requests and `2 · global_queue_limit` tenant
//! records.
//!
//! When the last queued request leaves, the busy period ends: `V` jumps to the largest
//! finish tag still tracked and every record is dropped (the usual start-time fair
//! queuing rule: with nobody waiting there is nobody to be fair to). An empty queue
//! therefore forgets everything, and a layer may let requests skip an empty queue
//! without changing any later decision.
//!
//! # Cancellation
//!
//! [`FairQueue::enqueue`] returns a [`Ticket`]: the request's slot in the slab and its
//! arrival number, which the queue never gives twice. [`FairQueue::cancel`] takes the
//! item back only if that slot still holds that arrival, so a ticket of a request already
//! dispatched or cancelled, even one whose slot was reused since, returns `None` and
//! touches nothing. A cancelled request is unlinked in O(1); when it was the head, the
//! next request inherits its start tag (nothing was served, so nothing is charged); when
//! it was the last, the tenant becomes idle with the finish tag it had. Enqueueing and
//! cancelling therefore never improves a tenant's position.
//!
//! # Example
//!
//! A greedy tenant of weight 1 and a small tenant of weight 3 share dispatches one to
//! three, whatever the greedy tenant has queued:
//!
//! ```
//! use tower_limits_core::fair_queue::{FairQueue, FairQueueConfig};
//!
//! let config = FairQueueConfig::new().tenant_queue_limit(100).global_queue_limit(200);
//! let mut queue = FairQueue::new(config).unwrap().with_weights([("interactive", 3)]);
//! for i in 0..100 {
//!     queue.enqueue("bulk", 1, i).unwrap();
//! }
//! for i in 0..20 {
//!     queue.enqueue("interactive", 1, i).unwrap();
//! }
//! let mut interactive = 0;
//! for _ in 0..20 {
//!     let next = queue.peek_next().unwrap();
//!     assert_eq!(next.cost, 1);
//!     if queue.pop_next().unwrap().key == "interactive" {
//!         interactive += 1;
//!     }
//! }
//! assert_eq!(interactive, 15);
//! assert_eq!(queue.tenant_stats(&"bulk").unwrap().dispatched_cost, 5);
//! ```

mod config;
mod heap;
mod lane;
mod slab;
mod stats;
mod tenant;

use std::fmt;
use std::hash::Hash;

use hashbrown::HashMap;

use crate::policy_error::PolicyError;
pub use config::{
    BandConfig, DEFAULT_GLOBAL_QUEUE_LIMIT, DEFAULT_TENANT_QUEUE_LIMIT, FairQueueConfig, MAX_BANDS, MAX_QUEUE_LIMIT,
    QueueFull, QueueKind,
};
use lane::Lane;
pub use slab::Ticket;
pub use stats::{FairQueueStats, TenantStats};

/// The request [`FairQueue::pop_next`] would dispatch, from [`FairQueue::peek_next`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Next<'a, K> {
    /// Its tenant.
    pub key: &'a K,
    /// Its ticket.
    pub ticket: Ticket,
    /// Its cost.
    pub cost: u64,
}

/// A request taken out of the queue by [`FairQueue::pop_next`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dispatched<K, T> {
    /// Its tenant.
    pub key: K,
    /// The ticket it had (it matches nothing any more).
    pub ticket: Ticket,
    /// Its cost, now counted as served to the tenant.
    pub cost: u64,
    /// Its item.
    pub item: T,
}

/// A weighted-fair queue of tenants' requests (start-time fair queuing), in priority
/// bands.
///
/// `K` is the tenant key (cloned once per dispatch: use a cheap one such as an `Arc`
/// or a [`TenantKey`](crate::TenantKey)); `T` is what a request leaves in the queue,
/// typically a waker slot or a sender. See the [module docs](crate::fair_queue) for how it works
/// and the laws it keeps.
pub struct FairQueue<K, T> {
    config: FairQueueConfig,
    /// The weights of tenants by key ([`FairQueue::with_weights`]); any other tenant has
    /// the configuration's `default_weight`.
    weights: HashMap<K, u32>,
    /// One per band, the first going first.
    lanes: Vec<Lane<K, T>>,
    /// Each band's minimum share, in millionths.
    shares: Vec<i128>,
    /// Each backlogged band's deficit: its minimum share of what was dispatched while it
    /// waited, less what it was served, in millionths of a cost unit.
    deficits: Vec<i128>,
    default_band: u8,
    global_limit: usize,
    queued: usize,
    next_seq: u64,
    refused_global: u64,
}

impl<K, T> fmt::Debug for FairQueue<K, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FairQueue")
            .field("config", &self.config)
            .field("queued", &self.queued)
            .field("bands", &self.lanes.len())
            .finish_non_exhaustive()
    }
}

/// Millionths in one.
const MILLION: i128 = 1_000_000;

impl<K: Hash + Eq + Clone, T> FairQueue<K, T> {
    /// An empty queue sharing by `config`.
    ///
    /// # Errors
    /// The first problem with the configuration, naming its field.
    pub fn new(config: FairQueueConfig) -> Result<Self, PolicyError> {
        config.validate()?;
        let (tenant_limit, global_limit) = (config.tenant_queue_limit, config.global_queue_limit);
        let bands = config.bands.len().max(1);
        let shares: Vec<i128> = if config.bands.is_empty() {
            vec![0]
        } else {
            config.bands.iter().map(|b| i128::from(b.min_share_percent) * 10_000).collect()
        };
        let default_band = config.default_band_index();
        Ok(FairQueue {
            lanes: (0..bands).map(|_| Lane::new(tenant_limit, global_limit)).collect(),
            shares,
            deficits: vec![0; bands],
            default_band: u8::try_from(default_band).unwrap_or(u8::MAX),
            global_limit,
            config,
            weights: HashMap::new(),
            queued: 0,
            next_seq: 0,
            refused_global: 0,
        })
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &FairQueueConfig {
        &self.config
    }

    /// The queue with each tenant's weight given by key: the configuration names tenants
    /// by text (`weights`), and the caller, which knows what those names stand for, gives
    /// them here as keys. A weight of 0 counts as 1. A later entry for the same key wins.
    ///
    /// ```
    /// use tower_limits_core::fair_queue::{FairQueue, FairQueueConfig};
    ///
    /// let queue: FairQueue<&str, ()> = FairQueue::new(FairQueueConfig::new())?.with_weights([("acme", 3)]);
    /// assert_eq!((queue.weight(&"acme"), queue.weight(&"globex")), (3, 1));
    /// # Ok::<(), tower_limits_core::PolicyError>(())
    /// ```
    #[must_use]
    pub fn with_weights(mut self, weights: impl IntoIterator<Item = (K, u32)>) -> Self {
        self.weights.extend(weights.into_iter().map(|(k, w)| (k, w.max(1))));
        self
    }

    /// The weight of tenant `key`: the one given by [`with_weights`](Self::with_weights),
    /// or the configuration's `default_weight`.
    #[must_use]
    pub fn weight(&self, key: &K) -> u32 {
        if self.weights.is_empty() {
            return self.config.default_weight;
        }
        self.weights.get(key).copied().unwrap_or(self.config.default_weight)
    }

    /// The band of requests queued without one ([`FairQueueConfig::default_band`]).
    #[must_use]
    pub fn default_band(&self) -> usize {
        usize::from(self.default_band)
    }

    /// How many bands the queue has (1 when none is configured).
    #[must_use]
    pub fn bands(&self) -> usize {
        self.lanes.len()
    }

    /// Queues a request of tenant `key` costing `cost` at the tenant's own
    /// [`weight`](Self::weight), in the default band, leaving `item` in the queue until it
    /// is dispatched or cancelled. A cost of 0 is queued in turn like any other and
    /// charges nothing.
    ///
    /// ```
    /// use tower_limits_core::fair_queue::{FairQueue, FairQueueConfig};
    ///
    /// let mut queue = FairQueue::new(FairQueueConfig::new())?.with_weights([("acme", 3)]);
    /// for _ in 0..4 {
    ///     queue.enqueue("acme", 1, ()).unwrap();
    ///     queue.enqueue("globex", 1, ()).unwrap();
    /// }
    /// let first: Vec<_> = (0..4).map(|_| queue.pop_next().unwrap().key).collect();
    /// assert_eq!(first.iter().filter(|k| **k == "acme").count(), 3); // three turns to one
    /// # Ok::<(), tower_limits_core::PolicyError>(())
    /// ```
    ///
    /// # Errors
    /// As [`enqueue_in`](Self::enqueue_in).
    pub fn enqueue(&mut self, key: K, cost: u64, item: T) -> Result<Ticket, QueueFull<T>> {
        let weight = self.weight(&key);
        self.enqueue_in(usize::from(self.default_band), key, weight, cost, item)
    }

    /// Queues a request of tenant `key` costing `cost` at the weight `weight` rather than
    /// its own, in the default band: for a weight that changes with what the caller
    /// learns (a replica's share of a fleet-wide tenant, see
    /// [`FleetShares`](crate::FleetShares)). `weight` becomes the tenant's weight for what
    /// it is served from now on, its queued requests included; a weight of 0 counts as 1.
    ///
    /// # Errors
    /// As [`enqueue_in`](Self::enqueue_in).
    pub fn enqueue_weighted(&mut self, key: K, weight: u32, cost: u64, item: T) -> Result<Ticket, QueueFull<T>> {
        self.enqueue_in(usize::from(self.default_band), key, weight, cost, item)
    }

    /// Queues a request of tenant `key` costing `cost` at weight `weight` in band `band`
    /// (0 is the first band configured, which goes first; a band beyond the last is the
    /// last). Within a band, tenants share by weight; a tenant's requests in different
    /// bands are queued and charged separately.
    ///
    /// ```
    /// use tower_limits_core::fair_queue::{FairQueue, FairQueueConfig};
    ///
    /// // Interactive first; batch keeps a quarter while it has work.
    /// let config = FairQueueConfig::new().band("interactive", 0).band("batch", 25);
    /// let mut queue = FairQueue::new(config)?;
    /// for _ in 0..8 {
    ///     queue.enqueue_in(1, "nightly", 1, 1, ()).unwrap();
    ///     queue.enqueue_in(0, "chat", 1, 1, ()).unwrap();
    /// }
    /// let first: Vec<usize> = (0..8).map(|_| queue.pop_next().unwrap().ticket.band()).collect();
    /// assert_eq!(first, [0, 1, 0, 0, 0, 1, 0, 0]);
    /// # Ok::<(), tower_limits_core::PolicyError>(())
    /// ```
    ///
    /// # Errors
    /// [`QueueFull`], giving `item` back, when the tenant already has
    /// `tenant_queue_limit` requests queued in the band ([`QueueKind::Tenant`], checked
    /// first) or the queue holds `global_queue_limit` in all ([`QueueKind::Global`]).
    /// Nothing changes but the refusal counters.
    pub fn enqueue_in(&mut self, band: usize, key: K, weight: u32, cost: u64, item: T) -> Result<Ticket, QueueFull<T>> {
        let band = band.min(self.lanes.len() - 1);
        let global_full = (self.queued >= self.global_limit).then_some(self.global_limit);
        let mut ticket = match self.lanes[band].enqueue(key, weight, cost, item, self.next_seq, global_full) {
            Ok(ticket) => ticket,
            Err(full) => {
                if full.kind == QueueKind::Global {
                    self.refused_global += 1;
                }
                return Err(full);
            }
        };
        self.next_seq += 1;
        self.queued += 1;
        ticket.band = band as u8;
        Ok(ticket)
    }

    /// The band that dispatches next: the band owed most of its minimum share, if any is
    /// owed (the first on a tie); otherwise the first band with requests queued.
    fn next_band(&self) -> Option<usize> {
        if self.lanes.len() == 1 {
            return (!self.lanes[0].is_empty()).then_some(0);
        }
        let mut owed: Option<(i128, usize)> = None;
        for (b, lane) in self.lanes.iter().enumerate() {
            let d = self.deficits[b];
            if d > 0 && !lane.is_empty() && owed.is_none_or(|(most, _)| d > most) {
                owed = Some((d, b));
            }
        }
        owed.map(|(_, b)| b).or_else(|| self.lanes.iter().position(|l| !l.is_empty()))
    }

    /// Replaces the bands' minimum shares while `shares` is `Some`: each band's share of
    /// what the queue dispatches while it waits, in millionths (a band not named keeps
    /// none); `None` restores the configured ones. For a fleet whose shared store gives
    /// this replica a part of the capacity per band
    /// ([`FleetShares::band_shares`](crate::FleetShares::band_shares)).
    ///
    /// ```
    /// use tower_limits_core::fair_queue::{FairQueue, FairQueueConfig};
    ///
    /// let mut queue = FairQueue::new(FairQueueConfig::new().band("interactive", 0).band("batch", 10))?;
    /// for _ in 0..4 {
    ///     queue.enqueue_in(0, "chat", 1, 1, ()).unwrap();
    ///     queue.enqueue_in(1, "nightly", 1, 1, ()).unwrap();
    /// }
    /// // Half of this replica's dispatches belong to the batch band here.
    /// queue.set_min_shares(Some(&[0, 500_000]));
    /// let order: Vec<_> = (0..4).map(|_| queue.pop_next().unwrap().key).collect();
    /// assert_eq!(order, ["chat", "nightly", "chat", "nightly"]);
    /// # Ok::<(), tower_limits_core::PolicyError>(())
    /// ```
    pub fn set_min_shares(&mut self, shares: Option<&[u32]>) {
        for (b, share) in self.shares.iter_mut().enumerate() {
            *share = match shares {
                Some(given) => i128::from(given.get(b).copied().unwrap_or(0).min(1_000_000)),
                None => self.config.bands.get(b).map_or(0, |c| i128::from(c.min_share_percent) * 10_000),
            };
        }
    }

    /// The request [`pop_next`](Self::pop_next) would dispatch now, without taking it.
    #[must_use]
    pub fn peek_next(&self) -> Option<Next<'_, K>> {
        let band = self.next_band()?;
        let mut next = self.lanes[band].peek_next()?;
        next.ticket.band = band as u8;
        Some(next)
    }

    /// Dispatches the next request: from the band [`peek_next`](Self::peek_next) names,
    /// the head, among its tenants with requests queued, with the smallest start tag (the
    /// earliest arrival on a tie). Its cost is charged to its tenant and counted to every
    /// waiting band's minimum share. `None` only when nothing is queued.
    pub fn pop_next(&mut self) -> Option<Dispatched<K, T>> {
        let band = self.next_band()?;
        self.pop_from(band)
    }

    /// As [`pop_next`](Self::pop_next), from `band` when it has requests queued (the
    /// band's head, charged and counted as `pop_next` would), and as `pop_next` when it
    /// has none: for a fleet whose shared store orders the bands
    /// ([`FleetShares::next_band`](crate::FleetShares::next_band)).
    ///
    /// ```
    /// use tower_limits_core::fair_queue::{FairQueue, FairQueueConfig};
    ///
    /// let mut queue = FairQueue::new(FairQueueConfig::new().band("interactive", 0).band("batch", 10))?;
    /// queue.enqueue_in(0, "chat", 1, 1, ()).unwrap();
    /// queue.enqueue_in(1, "nightly", 1, 1, ()).unwrap();
    /// assert_eq!(queue.pop_next_in(1).unwrap().key, "nightly");
    /// assert_eq!(queue.pop_next_in(1).unwrap().key, "chat", "nothing left in band 1");
    /// # Ok::<(), tower_limits_core::PolicyError>(())
    /// ```
    pub fn pop_next_in(&mut self, band: usize) -> Option<Dispatched<K, T>> {
        match self.lanes.get(band) {
            Some(lane) if !lane.is_empty() => self.pop_from(band),
            _ => self.pop_next(),
        }
    }

    /// Dispatches the head of `band`, which has requests queued.
    fn pop_from(&mut self, band: usize) -> Option<Dispatched<K, T>> {
        let mut out = self.lanes[band].pop_next()?;
        out.ticket.band = band as u8;
        self.queued -= 1;
        if self.lanes.len() > 1 {
            let cost = i128::from(out.cost);
            for (b, lane) in self.lanes.iter().enumerate() {
                if b == band || !lane.is_empty() {
                    self.deficits[b] = self.deficits[b].saturating_add(self.shares[b] * cost);
                }
            }
            self.deficits[band] = self.deficits[band].saturating_sub(MILLION * cost);
            if self.lanes[band].is_empty() {
                // Its backlog ended: a share is kept while a band waits, never banked.
                self.deficits[band] = 0;
            }
        }
        Some(out)
    }

    /// Takes a queued request out, returning its item; `None`, changing nothing, when the
    /// ticket's request was already dispatched or cancelled. Nothing is charged.
    pub fn cancel(&mut self, ticket: Ticket) -> Option<T> {
        let band = usize::from(ticket.band);
        let lane = self.lanes.get_mut(band)?;
        let item = lane.cancel(ticket)?;
        self.queued -= 1;
        if lane.is_empty() {
            self.deficits[band] = 0;
        }
        Some(item)
    }

    /// The item of a queued request.
    #[must_use]
    pub fn get(&self, ticket: Ticket) -> Option<&T> {
        self.lanes.get(usize::from(ticket.band))?.get(ticket)
    }

    /// The item of a queued request, to change it (say, to store a newer waker).
    #[must_use]
    pub fn get_mut(&mut self, ticket: Ticket) -> Option<&mut T> {
        self.lanes.get_mut(usize::from(ticket.band))?.get_mut(ticket)
    }

    /// How many requests are queued.
    #[must_use]
    pub fn len(&self) -> usize {
        self.queued
    }

    /// Whether nothing is queued.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.queued == 0
    }

    /// How many requests are queued in `band`.
    #[must_use]
    pub fn band_len(&self, band: usize) -> usize {
        self.lanes.get(band).map_or(0, Lane::len)
    }

    /// Counters of one tenant, over every band; `None` when the queue keeps no record of
    /// it (it has nothing queued and is due nothing more than a tenant never seen).
    #[must_use]
    pub fn tenant_stats(&self, key: &K) -> Option<TenantStats> {
        let mut found = self.lanes.iter().filter_map(|l| l.tenant_stats(key));
        let first = found.next()?;
        Some(found.fold(first, |a, b| TenantStats {
            weight: a.weight,
            queued: a.queued + b.queued,
            queued_cost: a.queued_cost.saturating_add(b.queued_cost),
            dispatched: a.dispatched + b.dispatched,
            dispatched_cost: a.dispatched_cost.saturating_add(b.dispatched_cost),
        }))
    }

    /// The tenants with requests queued, with how many requests and how much cost each
    /// has queued, in no particular order (a tenant waiting in two bands appears twice):
    /// what a fleet reports as this replica's demand
    /// ([`FleetShares`](crate::fleet::FleetShares)).
    ///
    /// ```
    /// use tower_limits_core::fair_queue::{FairQueue, FairQueueConfig};
    ///
    /// let mut queue = FairQueue::new(FairQueueConfig::new()).unwrap();
    /// queue.enqueue("a", 5, ()).unwrap();
    /// queue.enqueue("a", 2, ()).unwrap();
    /// assert_eq!(queue.backlog().collect::<Vec<_>>(), [(&"a", 2, 7)]);
    /// ```
    pub fn backlog(&self) -> impl Iterator<Item = (&K, u64, u64)> + '_ {
        self.lanes.iter().flat_map(Lane::backlog)
    }

    /// As [`backlog`](Self::backlog), for one band (nothing beyond the last).
    ///
    /// ```
    /// use tower_limits_core::fair_queue::{FairQueue, FairQueueConfig};
    ///
    /// let config = FairQueueConfig::new().band("interactive", 0).band("batch", 10);
    /// let mut queue = FairQueue::new(config).unwrap();
    /// queue.enqueue_in(1, "a", 1, 5, ()).unwrap();
    /// assert_eq!(queue.band_backlog(0).count(), 0);
    /// assert_eq!(queue.band_backlog(1).collect::<Vec<_>>(), [(&"a", 1, 5)]);
    /// ```
    pub fn band_backlog(&self, band: usize) -> impl Iterator<Item = (&K, u64, u64)> + '_ {
        self.lanes.get(band).into_iter().flat_map(Lane::backlog)
    }

    /// Counters of the whole queue, every band together.
    #[must_use]
    pub fn stats(&self) -> FairQueueStats {
        let mut all = FairQueueStats { refused_global_full: self.refused_global, ..FairQueueStats::default() };
        for lane in &self.lanes {
            let s = lane.stats();
            all.queued += s.queued;
            all.backlogged_tenants += s.backlogged_tenants;
            all.tracked_tenants += s.tracked_tenants;
            all.enqueued += s.enqueued;
            all.dispatched += s.dispatched;
            all.dispatched_cost = all.dispatched_cost.saturating_add(s.dispatched_cost);
            all.cancelled += s.cancelled;
            all.refused_tenant_full += s.refused_tenant_full;
            all.evicted_idle += s.evicted_idle;
        }
        all
    }

    /// Counters of one band (its refusals of a full queue apart); `None` beyond the last.
    #[must_use]
    pub fn band_stats(&self, band: usize) -> Option<FairQueueStats> {
        self.lanes.get(band).map(Lane::stats)
    }
}

#[cfg(test)]
mod tests;
