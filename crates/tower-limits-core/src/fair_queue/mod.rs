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
//! **Where things live.** This file holds [`FairQueue`] and its operations (enqueue,
//! dispatch, cancel, idle records); `tenant.rs` a tenant's record and its tag arithmetic;
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
mod slab;
mod stats;
mod tenant;

use std::fmt;
use std::hash::{BuildHasher, Hash};

use hashbrown::{DefaultHashBuilder, HashMap, HashTable};

use crate::policy_error::PolicyError;
pub use config::{
    DEFAULT_GLOBAL_QUEUE_LIMIT, DEFAULT_TENANT_QUEUE_LIMIT, FairQueueConfig, MAX_QUEUE_LIMIT, QueueFull, QueueKind,
};
use heap::{Entry, Heap};
pub use slab::Ticket;
use slab::{NONE, Node};
use stats::Counters;
pub use stats::{FairQueueStats, TenantStats};
use tenant::{Tenant, tenant, tenant_mut};

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

/// A weighted-fair queue of tenants' requests (start-time fair queuing).
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
    tenant_limit: usize,
    global_limit: usize,
    hasher: DefaultHashBuilder,
    /// Tenant slot numbers, found by the tenant's key.
    table: HashTable<u32>,
    tenants: Vec<Option<Tenant<K>>>,
    free_tenants: Vec<u32>,
    /// Each tenant's position in `backlogged` (when it has requests queued) or `idle`.
    positions: Vec<u32>,
    backlogged: Heap,
    idle: Heap,
    nodes: Vec<Node<T>>,
    free_node: u32,
    queued: usize,
    /// Virtual time, in 2^-32 cost units per weight.
    vtime: u128,
    next_seq: u64,
    counters: Counters,
}

impl<K, T> fmt::Debug for FairQueue<K, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FairQueue")
            .field("config", &self.config)
            .field("queued", &self.queued)
            .field("backlogged_tenants", &self.backlogged.entries.len())
            .field("tracked_tenants", &self.table.len())
            .finish_non_exhaustive()
    }
}

impl<K: Hash + Eq + Clone, T> FairQueue<K, T> {
    /// An empty queue sharing by `config`.
    ///
    /// # Errors
    /// The first problem with the configuration, naming its field.
    pub fn new(config: FairQueueConfig) -> Result<Self, PolicyError> {
        config.validate()?;
        Ok(FairQueue {
            tenant_limit: config.tenant_queue_limit,
            global_limit: config.global_queue_limit,
            config,
            weights: HashMap::new(),
            hasher: DefaultHashBuilder::default(),
            table: HashTable::new(),
            tenants: Vec::new(),
            free_tenants: Vec::new(),
            positions: Vec::new(),
            backlogged: Heap::default(),
            idle: Heap::default(),
            nodes: Vec::new(),
            free_node: NONE,
            queued: 0,
            vtime: 0,
            next_seq: 0,
            counters: Counters::default(),
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

    /// Queues a request of tenant `key` costing `cost` at the tenant's own
    /// [`weight`](Self::weight), leaving `item` in the queue until it is dispatched or
    /// cancelled. A cost of 0 is queued in turn like any other and charges nothing.
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
    /// As [`enqueue_weighted`](Self::enqueue_weighted).
    pub fn enqueue(&mut self, key: K, cost: u64, item: T) -> Result<Ticket, QueueFull<T>> {
        let weight = self.weight(&key);
        self.enqueue_weighted(key, weight, cost, item)
    }

    /// Queues a request of tenant `key` costing `cost` at the weight `weight` rather than
    /// its own: for a weight that changes with what the caller learns (a replica's share
    /// of a fleet-wide tenant, see [`FleetShares`](crate::FleetShares)). `weight`
    /// becomes the tenant's weight for what it is served from now on, its queued requests
    /// included; a weight of 0 counts as 1.
    ///
    /// # Errors
    /// [`QueueFull`], giving `item` back, when the tenant already has
    /// `tenant_queue_limit` requests queued ([`QueueKind::Tenant`], checked first) or the
    /// queue holds `global_queue_limit` ([`QueueKind::Global`]). Nothing changes but the
    /// refusal counters.
    pub fn enqueue_weighted(&mut self, key: K, weight: u32, cost: u64, item: T) -> Result<Ticket, QueueFull<T>> {
        let weight = weight.max(1);
        let hash = self.hasher.hash_one(&key);
        let tenants = &self.tenants;
        let found = self.table.find(hash, |&s| tenant(tenants, s).key == key).copied();
        if let Some(slot) = found {
            if tenant(&self.tenants, slot).len as usize >= self.tenant_limit {
                self.counters.refused_tenant += 1;
                return Err(QueueFull { kind: QueueKind::Tenant, limit: self.tenant_limit, item });
            }
        }
        if self.queued >= self.global_limit {
            self.counters.refused_global += 1;
            return Err(QueueFull { kind: QueueKind::Global, limit: self.global_limit, item });
        }

        let seq = self.next_seq;
        self.next_seq += 1;
        let (slot, fresh) = match found {
            Some(slot) => (slot, false),
            None => (self.add_tenant(key, hash, weight), true),
        };
        let node = self.add_node(Node { item: Some(item), seq, cost, tenant: slot, prev: NONE, next: NONE });
        let t = tenant_mut(&mut self.tenants, slot);
        let was_empty = t.len == 0;
        if t.tail == NONE {
            t.head = node;
        } else {
            self.nodes[t.tail as usize].next = node;
            self.nodes[node as usize].prev = t.tail;
        }
        t.tail = node;
        t.len += 1;
        t.queued_cost = t.queued_cost.saturating_add(cost);
        self.queued += 1;
        self.counters.enqueued += 1;

        if was_empty {
            if !fresh {
                // Idle with F > V: it starts at F, so take it off the idle heap.
                let at = self.positions[slot as usize] as usize;
                self.idle.remove(at, &mut self.positions);
            }
            let t = tenant_mut(&mut self.tenants, slot);
            t.reweight(weight);
            let entry = Entry { tag: t.tag, seq, tenant: slot };
            self.backlogged.push(entry, &mut self.positions);
        } else if t.reweight(weight) {
            let at = self.positions[slot as usize] as usize;
            let entry = Entry { tag: t.tag, ..self.backlogged.entries[at] };
            self.backlogged.replace_later(at, entry, &mut self.positions);
        }
        Ok(Ticket { slot: node, seq })
    }

    /// The request [`pop_next`](Self::pop_next) would dispatch now, without taking it.
    #[must_use]
    pub fn peek_next(&self) -> Option<Next<'_, K>> {
        let top = self.backlogged.entries.first()?;
        let t = tenant(&self.tenants, top.tenant);
        let node = &self.nodes[t.head as usize];
        Some(Next { key: &t.key, ticket: Ticket { slot: t.head, seq: node.seq }, cost: node.cost })
    }

    /// Dispatches the next request: the head, among the tenants with requests queued,
    /// with the smallest start tag (the earliest arrival on a tie). Its cost is charged
    /// to its tenant. `None` only when nothing is queued.
    pub fn pop_next(&mut self) -> Option<Dispatched<K, T>> {
        let top = *self.backlogged.entries.first()?;
        let slot = top.tenant;
        self.vtime = self.vtime.max(top.tag);
        let t = tenant_mut(&mut self.tenants, slot);
        let at = t.head;
        let node = &mut self.nodes[at as usize];
        let item = node.item.take()?;
        let (cost, seq, next) = (node.cost, node.seq, node.next);
        node.next = self.free_node;
        self.free_node = at;
        t.head = next;
        if next == NONE {
            t.tail = NONE;
        } else {
            self.nodes[next as usize].prev = NONE;
        }
        t.len -= 1;
        t.queued_cost = t.queued_cost.saturating_sub(cost);
        t.dispatched += 1;
        t.dispatched_cost = t.dispatched_cost.saturating_add(cost);
        t.advance(cost);
        let key = t.key.clone();
        self.queued -= 1;
        self.counters.dispatched += 1;
        self.counters.dispatched_cost = self.counters.dispatched_cost.saturating_add(cost);

        if next == NONE {
            self.backlogged.remove(0, &mut self.positions);
            self.park(slot);
        } else {
            // Still backlogged: the next head starts where this request finished.
            let entry = Entry { tag: t.tag, seq: self.nodes[next as usize].seq, tenant: slot };
            self.backlogged.replace_later(0, entry, &mut self.positions);
        }
        self.expire_idle();
        Some(Dispatched { key, ticket: Ticket { slot: at, seq }, cost, item })
    }

    /// Takes a queued request out, returning its item; `None`, changing nothing, when the
    /// ticket's request was already dispatched or cancelled. Nothing is charged.
    pub fn cancel(&mut self, ticket: Ticket) -> Option<T> {
        let node = self.nodes.get_mut(ticket.slot as usize)?;
        if node.seq != ticket.seq || node.item.is_none() {
            return None;
        }
        let item = node.item.take();
        let (slot, cost, prev, next) = (node.tenant, node.cost, node.prev, node.next);
        node.next = self.free_node;
        node.prev = NONE;
        self.free_node = ticket.slot;
        let t = tenant_mut(&mut self.tenants, slot);
        if prev == NONE {
            t.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NONE {
            t.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
        t.len -= 1;
        t.queued_cost = t.queued_cost.saturating_sub(cost);
        self.queued -= 1;
        self.counters.cancelled += 1;

        let at = self.positions[slot as usize] as usize;
        if t.len == 0 {
            self.backlogged.remove(at, &mut self.positions);
            // Its finish tag is the start tag its head had: nothing was served.
            self.park(slot);
            self.expire_idle();
        } else if prev == NONE {
            // The next request inherits the start tag; only the tie-break changes.
            let entry = Entry { seq: self.nodes[next as usize].seq, ..self.backlogged.entries[at] };
            self.backlogged.replace_later(at, entry, &mut self.positions);
        }
        item
    }

    /// The item of a queued request.
    #[must_use]
    pub fn get(&self, ticket: Ticket) -> Option<&T> {
        let node = self.nodes.get(ticket.slot as usize)?;
        if node.seq == ticket.seq { node.item.as_ref() } else { None }
    }

    /// The item of a queued request, to change it (say, to store a newer waker).
    #[must_use]
    pub fn get_mut(&mut self, ticket: Ticket) -> Option<&mut T> {
        let node = self.nodes.get_mut(ticket.slot as usize)?;
        if node.seq == ticket.seq { node.item.as_mut() } else { None }
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

    /// Counters of one tenant; `None` when the queue keeps no record of it (it has
    /// nothing queued and is due nothing more than a tenant never seen).
    #[must_use]
    pub fn tenant_stats(&self, key: &K) -> Option<TenantStats> {
        let hash = self.hasher.hash_one(key);
        let slot = *self.table.find(hash, |&s| tenant(&self.tenants, s).key == *key)?;
        let t = tenant(&self.tenants, slot);
        Some(TenantStats {
            weight: t.weight,
            queued: t.len as usize,
            queued_cost: t.queued_cost,
            dispatched: t.dispatched,
            dispatched_cost: t.dispatched_cost,
        })
    }

    /// The tenants with requests queued, with how many requests and how much cost each
    /// has queued, in no particular order: what a fleet reports as this replica's demand
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
        self.backlogged.entries.iter().map(|e| {
            let t = tenant(&self.tenants, e.tenant);
            (&t.key, u64::from(t.len), t.queued_cost)
        })
    }

    /// Counters of the whole queue.
    #[must_use]
    pub fn stats(&self) -> FairQueueStats {
        FairQueueStats {
            queued: self.queued,
            backlogged_tenants: self.backlogged.entries.len(),
            tracked_tenants: self.table.len(),
            enqueued: self.counters.enqueued,
            dispatched: self.counters.dispatched,
            dispatched_cost: self.counters.dispatched_cost,
            cancelled: self.counters.cancelled,
            refused_tenant_full: self.counters.refused_tenant,
            refused_global_full: self.counters.refused_global,
            evicted_idle: self.counters.evicted,
        }
    }

    fn add_tenant(&mut self, key: K, hash: u64, weight: u32) -> u32 {
        let record = Tenant::new(key, hash, self.vtime, weight);
        let slot = match self.free_tenants.pop() {
            Some(slot) => {
                self.tenants[slot as usize] = Some(record);
                slot
            }
            None => {
                self.tenants.push(Some(record));
                self.positions.push(NONE);
                (self.tenants.len() - 1) as u32
            }
        };
        let tenants = &self.tenants;
        self.table.insert_unique(hash, slot, |&s| tenant(tenants, s).hash);
        slot
    }

    /// Files a tenant whose queue just emptied: dropped when its finish tag is reached,
    /// kept on the idle heap otherwise.
    fn park(&mut self, slot: u32) {
        let finish = tenant(&self.tenants, slot).ceil_tag();
        if finish <= self.vtime {
            self.drop_tenant(slot);
            return;
        }
        self.idle.push(Entry { tag: finish, seq: u64::from(slot), tenant: slot }, &mut self.positions);
        if self.idle.entries.len() > self.global_limit {
            // Forget the one due least: it may start up to its last cost/weight early.
            let oldest = self.idle.remove(0, &mut self.positions);
            self.drop_tenant(oldest.tenant);
            self.counters.evicted += 1;
        }
    }

    /// Drops idle records whose finish tag virtual time has reached, and everything at
    /// the end of a busy period.
    fn expire_idle(&mut self) {
        if self.backlogged.entries.is_empty() {
            self.end_busy_period();
            return;
        }
        while let Some(&top) = self.idle.entries.first() {
            if top.tag > self.vtime {
                break;
            }
            self.idle.remove(0, &mut self.positions);
            self.drop_tenant(top.tenant);
        }
    }

    /// Nothing is queued: virtual time moves past every finish tag and all records go.
    fn end_busy_period(&mut self) {
        debug_assert_eq!(self.queued, 0);
        if let Some(latest) = self.idle.entries.iter().map(|e| e.tag).max() {
            self.vtime = self.vtime.max(latest);
        }
        self.idle.entries.clear();
        self.table.clear();
        self.tenants.clear();
        self.free_tenants.clear();
        self.positions.clear();
        self.nodes.clear();
        self.free_node = NONE;
    }

    fn drop_tenant(&mut self, slot: u32) {
        let hash = tenant(&self.tenants, slot).hash;
        if let Ok(entry) = self.table.find_entry(hash, |&s| s == slot) {
            entry.remove();
        }
        self.tenants[slot as usize] = None;
        self.positions[slot as usize] = NONE;
        self.free_tenants.push(slot);
    }
}

#[cfg(test)]
mod tests;
