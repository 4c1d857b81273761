//! The state every service of one fair-queue layer shares, and every decision made on it.
//!
//! # One lock, three places a request can be
//!
//! All decisions are made under one mutex, by whoever changes something: a request
//! arriving (`arrive`), a waiter polled or dropped (`poll_waiter`, `leave`), an admitted
//! request finishing (`release`). Nothing runs in the background. Wakers are gathered in
//! a [`Wakers`] under the lock and woken by the caller once it is released, as in the
//! limit layers' [waiting machine](crate::wait), whose rule this queue follows too: a
//! release wakes only the one request that can use it (here, the one at the gate).
//!
//! A request that cannot be admitted at once is in exactly one of three places, all
//! found by its ticket's arrival number:
//!
//! 1. **queued** in the [`FairQueue`], with its waker and deadline;
//! 2. **at the gate**: the one request the scheduler chose next, holding a slot, waiting
//!    for the rate backend to grant it (a [`Gate`]);
//! 3. **decided**: granted or refused, its outcome in `outcomes` until its waiter comes
//!    to take it.
//!
//! # Where things live
//!
//! This file holds [`Shared`], the [`State`] behind its lock and the events that change
//! it (arrive, poll a waiter, leave, release); `pump.rs` the pump, which dispatches in
//! fair order; `gate.rs` the request at the gate and its timer; `stats.rs` the counters;
//! `fixed.rs` the settings and [`NoRate`]. The wakers owed after the lock are the
//! waiting machine's ([`crate::wait::Wakers`]).
//!
//! # Cancellation
//!
//! A dropped waiter leaves from wherever it is: cancelled from the queue (O(log n), no
//! pump needed: capacity did not change); cleared from the gate (its slot comes back, the
//! pump runs); or, if it was granted but not yet told, its grant is refunded to the
//! backend, its slot comes back, and the pump dispatches the next tenant.

mod fixed;
mod gate;
mod pump;
mod stats;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use hashbrown::HashMap;
use tower_limits_core::fair_queue::{FairQueue, QueueFull, QueueKind, Ticket};
use tower_limits_core::fleet::Waiting;
use tower_limits_core::{Backend, Clock, Instant, PolicyError, TenantKey};

use crate::clock::LayerClock;
use crate::error::{ErrorKind, LimitError};
use crate::wait::{Wakers, set_waker};
pub(crate) use fixed::Fixed;
pub use fixed::NoRate;
use gate::{Gate, Outcome, Stage, waitable};
use stats::{Counters, Records};
pub use stats::{FairQueueLayerStats, Refusals, TenantQueueStats};

/// The name a refusal by the fair queue itself carries as its limit.
pub(crate) const FAIR_QUEUE: &str = "fair_queue";

/// The settings and the state behind the lock.
pub(crate) struct Shared<B: Backend> {
    pub(crate) fixed: Fixed<B>,
    pub(crate) key_watch: crate::extract::KeyWatch,
    state: Mutex<State<B>>,
}

impl<B: Backend> Shared<B> {
    pub(crate) fn new(fixed: Fixed<B>) -> Result<Self, PolicyError> {
        let queue =
            FairQueue::new(fixed.config.clone())?.with_weights(fixed.weights.iter().map(|(k, w)| (k.clone(), *w)));
        let state = State {
            queue,
            in_flight: 0,
            gate: None,
            outcomes: HashMap::new(),
            counters: Counters::default(),
            records: Records { map: HashMap::new(), limit: fixed.tracked_tenants, cooldown: 0 },
        };
        Ok(Shared { fixed, key_watch: crate::extract::KeyWatch::default(), state: Mutex::new(state) })
    }

    fn lock(&self) -> MutexGuard<'_, State<B>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn clock(&self, floor: Instant) -> Now<'_> {
        Now { clock: &self.fixed.clock, floor, read: None }
    }

    /// A request arrives: admitted at once, queued, or refused.
    pub(crate) fn arrive(&self, key: &TenantKey, band: Option<usize>, cost: u64) -> Arrival<B::Grant> {
        let mut wake = Wakers::default();
        let arrival = self.lock().arrive(&self.fixed, key, band, cost, &mut self.clock(Instant::ZERO), &mut wake);
        wake.wake();
        arrival
    }

    /// Counts a refusal made before the request reached the queue.
    /// The weight tenant `key` is queued with, before any fleet scaling.
    pub(crate) fn weight(&self, key: &TenantKey) -> u32 {
        self.lock().queue.weight(key)
    }

    pub(crate) fn count_refusal(&self, kind: ErrorKind) {
        self.lock().counters.refused.count(kind);
    }

    /// Where a waiter stands; see [`State::poll_waiter`].
    pub(crate) fn poll_waiter(
        &self,
        ticket: Ticket,
        key: &TenantKey,
        cx: &mut Context<'_>,
        floor: Instant,
    ) -> WaiterStep<B::Grant> {
        let mut wake = Wakers::default();
        let step = self.lock().poll_waiter(&self.fixed, ticket, key, cx, &mut self.clock(floor), &mut wake);
        wake.wake();
        step
    }

    /// A waiter was dropped before it learned its outcome.
    pub(crate) fn leave(&self, ticket: Ticket, key: &TenantKey) {
        let mut wake = Wakers::default();
        self.lock().leave(&self.fixed, ticket, key, &mut self.clock(Instant::ZERO), &mut wake);
        wake.wake();
    }

    /// An admitted request finished (or was dropped): its slot comes back. After a
    /// settle that gave cost back (`gave_back`), the gate's request is tried again at
    /// once.
    pub(crate) fn release(&self, gave_back: bool) {
        let mut wake = Wakers::default();
        self.lock().release(&self.fixed, &mut self.clock(Instant::ZERO), &mut wake, gave_back);
        wake.wake();
    }

    /// Now, on the layer's clock.
    pub(crate) fn now(&self) -> Instant {
        self.fixed.clock.now()
    }
}

impl<B: Backend> fmt::Debug for Shared<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.fixed.fmt(f)
    }
}

/// What became of an arriving request.
pub(crate) enum Arrival<G> {
    /// Admitted at once: call the inner service. With the tenant's weight when the fleet
    /// publishes admissions.
    Admitted(G, Option<u32>),
    /// Queued (or at the gate): wait with this ticket.
    Queued(Ticket),
    /// Refused.
    Refused(Box<LimitError>),
}

/// What a waiter learns when it is polled.
pub(crate) enum WaiterStep<G> {
    /// Decided: granted, or refused.
    Done(Result<Admitted<G>, Box<LimitError>>),
    /// Still waiting; sleep until the instant if there is one (its deadline, or, at the
    /// gate, the instant the rate lets it pass; `at_gate` says which). The waker is kept.
    Sleep { until: Option<Instant>, at_gate: bool },
    /// Something changed under the lock; look again.
    Again,
}

/// A grant and what the admission tells the tracing (and, when the fleet publishes
/// admissions, the tenant's weight, read under the same lock).
pub(crate) struct Admitted<G> {
    pub(crate) grant: G,
    /// The cost the grant charged.
    pub(crate) cost: u64,
    pub(crate) waited: Duration,
    pub(crate) weight: Option<u32>,
}

/// A request in the fair queue.
struct Queued {
    waker: Option<Waker>,
    since: Instant,
    deadline: Option<Instant>,
}

/// The time of one decision: read from the clock only if the decision needs it, once,
/// and never before `floor` (an instant a timer of the caller already fired for).
pub(crate) struct Now<'a> {
    clock: &'a LayerClock,
    floor: Instant,
    read: Option<Instant>,
}

impl Now<'_> {
    fn get(&mut self) -> Instant {
        *self.read.get_or_insert_with(|| self.clock.now().max(self.floor))
    }
}

fn poll_once<F: Future + Unpin>(fut: &mut F) -> Poll<F::Output> {
    Pin::new(fut).poll(&mut Context::from_waker(Waker::noop()))
}

fn queue_timeout() -> Box<LimitError> {
    Box::new(
        LimitError { limit: Some(FAIR_QUEUE), ..LimitError::new(ErrorKind::WaitTimedOut) }
            .with_detail("waited the maximum queueing time"),
    )
}

pub(crate) struct State<B: Backend> {
    queue: FairQueue<TenantKey, Queued>,
    /// Slots taken.
    in_flight: usize,
    gate: Option<Gate<B>>,
    /// Decided requests whose waiters have not looked yet, by arrival number.
    outcomes: HashMap<u64, Outcome<B::Grant>>,
    counters: Counters,
    records: Records,
}

impl<B: Backend> State<B> {
    /// The weight an admission publishes to the fleet, when there is one.
    fn fleet_weight(&self, fx: &Fixed<B>, key: &TenantKey) -> Option<u32> {
        fx.fleet.as_ref().map(|_| self.queue.weight(key))
    }

    fn arrive(
        &mut self,
        fx: &Fixed<B>,
        key: &TenantKey,
        band: Option<usize>,
        cost: u64,
        now: &mut Now<'_>,
        wake: &mut Wakers,
    ) -> Arrival<B::Grant> {
        let t = now.get();
        let deadline = fx.max_queue_time.map(|d| t + d);
        let item = Queued { waker: None, since: t, deadline };
        if !(self.queue.is_empty() && self.gate.is_none() && self.in_flight < fx.slots) {
            return match self.enqueue(fx, key, band, cost, item) {
                Ok(ticket) => {
                    self.pump(fx, now, wake);
                    Arrival::Queued(ticket)
                }
                Err(full) => Arrival::Refused(self.full(key, &full, t)),
            };
        }
        // Nothing queued and capacity free: skip the queue.
        self.publish_backlog(fx, Some((key, band.unwrap_or_else(|| self.queue.default_band()))));
        let mut acquire = fx.backend.acquire(key, cost, t);
        match poll_once(&mut acquire) {
            Poll::Ready(Ok(grant)) => {
                self.in_flight += 1;
                self.count_admission(key, cost, None, t);
                Arrival::Admitted(grant, self.fleet_weight(fx, key))
            }
            Poll::Ready(Err(e)) if !waitable(&e) => {
                let error = Box::new(LimitError::from(e));
                self.counters.refused.count(error.kind());
                Arrival::Refused(error)
            }
            result => {
                // Not yet (or a remote backend): to the gate, through the queue, so that
                // the request has a ticket. The queue was empty: it pops this request.
                let ticket = match self.enqueue(fx, key, band, cost, item) {
                    Ok(ticket) => ticket,
                    Err(full) => return Arrival::Refused(self.full(key, &full, t)),
                };
                if let Some(next) = self.queue.pop_next() {
                    self.in_flight += 1;
                    let gate = Gate {
                        id: next.ticket.arrival(),
                        band: next.ticket.band(),
                        key: next.key,
                        cost: next.cost,
                        since: next.item.since,
                        deadline: next.item.deadline,
                        waker: None,
                        stage: Stage::AwaitRelease,
                        on_release: false,
                    };
                    match result {
                        Poll::Ready(r) => self.resolve(gate, r, now, wake),
                        Poll::Pending => self.await_remote(gate, acquire, wake),
                    }
                    self.pump(fx, now, wake);
                }
                Arrival::Queued(ticket)
            }
        }
    }

    /// Queues a request at its tenant's weight, scaled by this replica's share of the
    /// tenant's fleet demand when the layer serves a fleet (see
    /// [`tower_limits_core::fleet`]).
    fn enqueue(
        &mut self,
        fx: &Fixed<B>,
        key: &TenantKey,
        band: Option<usize>,
        cost: u64,
        item: Queued,
    ) -> Result<tower_limits_core::Ticket, QueueFull<Queued>> {
        let own = self.queue.weight(key);
        let weight = match &fx.fleet {
            None => own,
            Some(fleet) => fleet.local_weight(key, own),
        };
        let band = band.unwrap_or_else(|| self.queue.default_band());
        self.queue.enqueue_in(band, key.clone(), weight, cost, item)
    }

    /// Tells the fleet (if the layer serves one) what this replica has waiting, in
    /// requests per tenant and band: the queue's backlog and `extra`, the request about
    /// to be acquired (its tenant and band), whose band the fleet orders.
    pub(super) fn publish_backlog(&self, fx: &Fixed<B>, extra: Option<(&TenantKey, usize)>) {
        let Some(fleet) = &fx.fleet else { return };
        let queue = &self.queue;
        let waiting = (0..queue.bands()).flat_map(|band| {
            queue.band_backlog(band).map(move |(k, n, _)| Waiting::new(k.clone(), queue.weight(k), n).in_band(band))
        });
        let gate = extra.map(|(key, band)| Waiting::new(key.clone(), queue.weight(key), 1).in_band(band));
        fleet.publish(waiting.chain(gate), extra.map_or(0, |(_, band)| band));
    }

    /// A full queue's refusal, with a `Retry-After` estimate for the tenant's own queue.
    fn full(&mut self, key: &TenantKey, full: &QueueFull<Queued>, now: Instant) -> Box<LimitError> {
        let kind = if full.kind() == QueueKind::Tenant { ErrorKind::TenantQueueFull } else { ErrorKind::QueueFull };
        self.counters.refused.count(kind);
        let mut error = LimitError::new(kind).with_detail(full.to_string());
        if kind == ErrorKind::TenantQueueFull {
            error.retry_after = self.records.map.get(key).and_then(|r| {
                let due = r.interval.saturating_sub(now.saturating_since(r.last_admitted));
                Some(if due.is_zero() { r.interval } else { due }).filter(|d| !d.is_zero())
            });
        }
        Box::new(error)
    }

    /// Where the waiter of `ticket` stands, storing its waker; decides what is due.
    fn poll_waiter(
        &mut self,
        fx: &Fixed<B>,
        ticket: Ticket,
        key: &TenantKey,
        cx: &mut Context<'_>,
        now: &mut Now<'_>,
        wake: &mut Wakers,
    ) -> WaiterStep<B::Grant> {
        if let Some(queued) = self.queue.get_mut(ticket) {
            if queued.deadline.is_some_and(|d| now.get() >= d) {
                self.queue.cancel(ticket);
                let error = queue_timeout();
                self.counters.refused.count(error.kind());
                return WaiterStep::Done(Err(error));
            }
            set_waker(&mut queued.waker, cx);
            return WaiterStep::Sleep { until: queued.deadline, at_gate: false };
        }
        let id = ticket.arrival();
        if let Some(gate) = self.gate.as_mut().filter(|g| g.id == id) {
            set_waker(&mut gate.waker, cx);
            match &mut gate.stage {
                Stage::Sleeping(at) if now.get() < *at => return WaiterStep::Sleep { until: Some(*at), at_gate: true },
                Stage::Sleeping(_) => {
                    self.retry_gate(fx, now, wake);
                    return WaiterStep::Again;
                }
                Stage::AwaitRelease => {
                    if gate.deadline.is_some_and(|d| now.get() >= d) {
                        self.gate = None;
                        self.free_slot();
                        let error = queue_timeout();
                        self.counters.refused.count(error.kind());
                        self.pump(fx, now, wake);
                        return WaiterStep::Done(Err(error));
                    }
                    return WaiterStep::Sleep { until: gate.deadline, at_gate: true };
                }
                Stage::Acquiring(acquire) => {
                    let Poll::Ready(result) = Pin::new(acquire).poll(cx) else {
                        return WaiterStep::Sleep { until: None, at_gate: true };
                    };
                    if let Some(gate) = self.gate.take() {
                        self.resolve(gate, result, now, wake);
                    }
                    self.pump(fx, now, wake);
                    return WaiterStep::Again;
                }
            }
        }
        match self.outcomes.remove(&id) {
            Some(Outcome::Granted { grant, cost, since, at }) => {
                let waited = at.saturating_since(since);
                self.count_admission(key, cost, Some(waited), at);
                WaiterStep::Done(Ok(Admitted { grant, cost, waited, weight: self.fleet_weight(fx, key) }))
            }
            Some(Outcome::Refused(error)) => WaiterStep::Done(Err(error)),
            None => WaiterStep::Done(Err(Box::new(
                LimitError::new(ErrorKind::Unavailable).with_detail("the fair queue lost track of the request"),
            ))),
        }
    }

    /// The waiter of `ticket` was dropped undecided or untold.
    fn leave(&mut self, fx: &Fixed<B>, ticket: Ticket, key: &TenantKey, now: &mut Now<'_>, wake: &mut Wakers) {
        if self.queue.cancel(ticket).is_some() {
            // Capacity did not change: nothing to pump.
            self.counters.cancelled += 1;
            return;
        }
        let id = ticket.arrival();
        if self.gate.as_ref().is_some_and(|g| g.id == id) {
            self.gate = None;
            self.free_slot();
            self.counters.cancelled += 1;
            self.pump(fx, now, wake);
            return;
        }
        if let Some(Outcome::Granted { grant, .. }) = self.outcomes.remove(&id) {
            // Granted as it was dropped: the grant goes back and the next one goes.
            fx.backend.cancel(key, grant, now.get());
            self.free_slot();
            self.counters.cancelled += 1;
            self.retry_gate(fx, now, wake);
        }
    }

    /// An admitted request let go of its slot.
    fn release(&mut self, fx: &Fixed<B>, now: &mut Now<'_>, wake: &mut Wakers, gave_back: bool) {
        self.free_slot();
        if gave_back || self.gate.as_ref().is_some_and(|g| g.on_release) {
            self.retry_gate(fx, now, wake);
        } else {
            self.pump(fx, now, wake);
        }
    }
}
