//! One band of a [`FairQueue`](super::FairQueue): start-time fair queuing of the tenants
//! whose requests wait in it, as the module docs describe. Each band keeps its own
//! virtual time, tenant records, requests and busy periods; the queue decides which band
//! dispatches next.

use std::hash::{BuildHasher, Hash};

use hashbrown::{DefaultHashBuilder, HashTable};

use super::heap::{Entry, Heap};
use super::slab::{NONE, Node, Ticket};
use super::stats::{Counters, FairQueueStats, TenantStats};
use super::tenant::{Tenant, tenant, tenant_mut};
use super::{Dispatched, Next, QueueFull, QueueKind};

/// One band of a [`FairQueue`]: start-time fair queuing of its tenants, with its own
/// virtual time, tenant records and busy periods (see the module docs).
pub(super) struct Lane<K, T> {
    pub(super) tenant_limit: usize,
    pub(super) global_limit: usize,
    pub(super) hasher: DefaultHashBuilder,
    /// Tenant slot numbers, found by the tenant's key.
    pub(super) table: HashTable<u32>,
    pub(super) tenants: Vec<Option<Tenant<K>>>,
    pub(super) free_tenants: Vec<u32>,
    /// Each tenant's position in `backlogged` (when it has requests queued) or `idle`.
    pub(super) positions: Vec<u32>,
    pub(super) backlogged: Heap,
    pub(super) idle: Heap,
    pub(super) nodes: Vec<Node<T>>,
    pub(super) free_node: u32,
    pub(super) queued: usize,
    /// Virtual time, in 2^-32 cost units per weight.
    pub(super) vtime: u128,
    pub(super) counters: Counters,
}

impl<K: Hash + Eq + Clone, T> Lane<K, T> {
    /// An empty band holding at most `tenant_limit` requests per tenant, and at most
    /// `global_limit` idle tenant records.
    pub(super) fn new(tenant_limit: usize, global_limit: usize) -> Self {
        Lane {
            tenant_limit,
            global_limit,
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
            counters: Counters::default(),
        }
    }

    /// Queues a request of tenant `key` at `weight` with arrival number `seq`. Refused
    /// when the tenant's queue in this band is full (checked first), or, with
    /// `global_full` (the limit), because the whole queue is.
    pub(super) fn enqueue(
        &mut self,
        key: K,
        weight: u32,
        cost: u64,
        item: T,
        seq: u64,
        global_full: Option<usize>,
    ) -> Result<Ticket, QueueFull<T>> {
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
        if let Some(limit) = global_full {
            return Err(QueueFull { kind: QueueKind::Global, limit, item });
        }

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
        Ok(Ticket { slot: node, seq, band: 0 })
    }

    /// The request [`pop_next`](Self::pop_next) would dispatch now, without taking it.
    #[must_use]
    pub(super) fn peek_next(&self) -> Option<Next<'_, K>> {
        let top = self.backlogged.entries.first()?;
        let t = tenant(&self.tenants, top.tenant);
        let node = &self.nodes[t.head as usize];
        Some(Next { key: &t.key, ticket: Ticket { slot: t.head, seq: node.seq, band: 0 }, cost: node.cost })
    }

    /// Dispatches the next request: the head, among the tenants with requests queued,
    /// with the smallest start tag (the earliest arrival on a tie). Its cost is charged
    /// to its tenant. `None` only when nothing is queued.
    pub(super) fn pop_next(&mut self) -> Option<Dispatched<K, T>> {
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
        Some(Dispatched { key, ticket: Ticket { slot: at, seq, band: 0 }, cost, item })
    }

    /// Takes a queued request out, returning its item; `None`, changing nothing, when the
    /// ticket's request was already dispatched or cancelled. Nothing is charged.
    pub(super) fn cancel(&mut self, ticket: Ticket) -> Option<T> {
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
    pub(super) fn get(&self, ticket: Ticket) -> Option<&T> {
        let node = self.nodes.get(ticket.slot as usize)?;
        if node.seq == ticket.seq { node.item.as_ref() } else { None }
    }

    /// The item of a queued request, to change it (say, to store a newer waker).
    #[must_use]
    pub(super) fn get_mut(&mut self, ticket: Ticket) -> Option<&mut T> {
        let node = self.nodes.get_mut(ticket.slot as usize)?;
        if node.seq == ticket.seq { node.item.as_mut() } else { None }
    }

    /// How many requests are queued.
    #[must_use]
    pub(super) fn len(&self) -> usize {
        self.queued
    }

    /// Whether nothing is queued.
    #[must_use]
    pub(super) fn is_empty(&self) -> bool {
        self.queued == 0
    }

    /// Counters of one tenant; `None` when the queue keeps no record of it (it has
    /// nothing queued and is due nothing more than a tenant never seen).
    #[must_use]
    pub(super) fn tenant_stats(&self, key: &K) -> Option<TenantStats> {
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
    pub(super) fn backlog(&self) -> impl Iterator<Item = (&K, u64, u64)> + '_ {
        self.backlogged.entries.iter().map(|e| {
            let t = tenant(&self.tenants, e.tenant);
            (&t.key, u64::from(t.len), t.queued_cost)
        })
    }

    /// Counters of this band (its refusals of a full queue excepted: the queue counts those).
    #[must_use]
    pub(super) fn stats(&self) -> FairQueueStats {
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

    pub(super) fn add_node(&mut self, node: Node<T>) -> u32 {
        if self.free_node == NONE {
            self.nodes.push(node);
            (self.nodes.len() - 1) as u32
        } else {
            let at = self.free_node;
            let slot = &mut self.nodes[at as usize];
            self.free_node = slot.next;
            *slot = node;
            at
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
