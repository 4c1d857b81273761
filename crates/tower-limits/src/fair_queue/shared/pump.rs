//! The pump: dispatching in fair order while capacity is free.
//!
//! [`State::pump`] runs after every change that can free capacity. While no request is at
//! the gate and a slot is free, it dispatches the next request of the fair queue: takes a
//! slot, asks the backend, and either records the grant, refuses the request (a refusal
//! that waiting cannot fix: the tenant's own limit, a cost above capacity, an unavailable
//! backend; the next request goes on) or, when a shared limit says "not yet", leaves the
//! request at the gate. The queue is never skipped: a small request behind a large one at
//! the gate waits, or large requests would starve.
//!
//! Before each acquisition the layer of a fleet replica publishes its backlog (the queue's
//! and the request about to be acquired) to its
//! [`FleetShares`](tower_limits_core::fleet::FleetShares) handle, for the shared store to
//! report (`State::publish_backlog`).
//!
//! Invariant: when anything is queued, no capacity is free (a request is at the gate, or
//! every slot is taken). Every event that frees capacity pumps; so an arrival that finds
//! the queue empty, nobody at the gate and a free slot may skip the queue, which the
//! scheduler allows: an empty queue keeps no record, so skipping it changes nothing later.

use std::task::Poll;

use tower_limits_core::Backend;

use super::{Fixed, Gate, Now, Stage, State, Wakers, poll_once, queue_timeout};

impl<B: Backend> State<B> {
    /// Dispatches in fair order while capacity is free.
    pub(super) fn pump(&mut self, fx: &Fixed<B>, now: &mut Now<'_>, wake: &mut Wakers) {
        while self.gate.is_none() && self.in_flight < fx.slots {
            if let Some(fleet) = &fx.fleet {
                self.queue.set_min_shares(fleet.band_shares().as_deref());
            }
            let asked = fx.fleet.as_ref().and_then(|f| f.next_band());
            let Some(next) = (match asked {
                Some(band) => self.queue.pop_next_in(band),
                None => self.queue.pop_next(),
            }) else {
                break;
            };
            self.in_flight += 1;
            let gate = Gate {
                id: next.ticket.arrival(),
                band: next.ticket.band(),
                key: next.key,
                cost: next.cost,
                since: next.item.since,
                deadline: next.item.deadline,
                waker: next.item.waker,
                stage: Stage::AwaitRelease,
                on_release: false,
            };
            self.begin(fx, gate, now, wake);
        }
    }

    /// Asks the backend for the gate's request (unless its deadline has come).
    pub(super) fn begin(&mut self, fx: &Fixed<B>, gate: Gate<B>, now: &mut Now<'_>, wake: &mut Wakers) {
        let now_at = now.get();
        if gate.deadline.is_some_and(|d| now_at >= d) {
            self.free_slot();
            self.refuse(gate.id, queue_timeout(), gate.waker, wake);
            return;
        }
        self.publish_backlog(fx, Some((&gate.key, gate.band)));
        let mut acquire = fx.backend.acquire(&gate.key, gate.cost, now_at);
        match poll_once(&mut acquire) {
            Poll::Ready(result) => self.resolve(gate, result, now, wake),
            Poll::Pending => self.await_remote(gate, acquire, wake),
        }
    }

    pub(super) fn free_slot(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }
}
