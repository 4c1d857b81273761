//! The state every service of one fair-queue layer shares, and every decision made on it.
//!
//! # One lock, three places a request can be
//!
//! All decisions are made under one mutex, by whoever changes something: a request
//! arriving (`arrive`), a waiter polled or dropped (`poll_waiter`, `leave`), an admitted
//! request finishing (`release`). Nothing runs in the background. Wakers are gathered in
//! a [`Wakers`] under the lock and woken by the caller once it is released.
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
//! # The pump
//!
//! [`State::pump`] runs after every change that can free capacity. While no request is at
//! the gate and a slot is free, it dispatches the next request of the fair queue: takes a
//! slot, asks the backend, and either records the grant, refuses the request (a denial
//! that waiting cannot fix: the tenant's own limit, a cost above capacity, an unavailable
//! backend; the next request goes on) or, when a shared limit says "not yet", leaves the
//! request at the gate. The queue is never skipped: a small request behind a large one at
//! the gate waits, or large requests would starve.
//!
//! Invariant: when anything is queued, no capacity is free (a request is at the gate, or
//! every slot is taken). Every event that frees capacity pumps; so an arrival that finds
//! the queue empty, nobody at the gate and a free slot may skip the queue, which the
//! scheduler allows: an empty queue keeps no record, so skipping it changes nothing later.
//!
//! # The gate and its timer
//!
//! The request at the gate owns the timer: its waiter sleeps until the instant the
//! backend named (`retry_after`), then retries under the lock. Only it is woken for that,
//! so a rate instant wakes one task, not every waiter. The duty moves with the gate: when
//! the gate's request is granted, refused, timed out or dropped, the gate is cleared and
//! the pump puts the next request there, waking its waiter to arm its own timer. No
//! wake-up is lost, because whoever changes the gate wakes its new owner. A gate blocked by
//! a semaphore of the backend waits for a release instead; a release or a refund retries
//! it at once. With a remote backend whose acquisition is still in flight, the gate's
//! waiter polls it.
//!
//! # Cancellation
//!
//! A dropped waiter leaves from wherever it is: cancelled from the queue (O(log n), no
//! pump needed: capacity did not change); cleared from the gate (its slot comes back, the
//! pump runs); or, if it was granted but not yet told, its grant is refunded to the
//! backend, its slot comes back, and the pump dispatches the next tenant.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use hashbrown::HashMap;
use tower_limits_core::fair_queue::{FairQueue, FairQueueConfig, QueueFull, QueueKind, Ticket};
use tower_limits_core::{AcquireError, Backend, Clock, Instant, PolicyError, TenantKey};

use crate::clock::LayerClock;
use crate::error::{ErrorKind, LimitError};

/// The name a refusal by the fair queue itself carries as its limit.
pub(crate) const FAIR_QUEUE: &str = "fair_queue";

/// The shortest retry after a denial that names no wait (a backend that cannot say).
const MIN_RETRY: Duration = Duration::from_millis(1);

/// A backend with no limits: every acquisition is granted at once. The rate of a
/// [`FairQueueLayer`](super::FairQueueLayer) whose capacity is concurrency only.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoRate;

impl Backend for NoRate {
    type Grant = ();
    type Acquire = std::future::Ready<Result<(), AcquireError>>;

    #[inline]
    fn acquire(&self, _key: &TenantKey, _cost: u64, _now: Instant) -> Self::Acquire {
        std::future::ready(Ok(()))
    }

    #[inline]
    fn settle(&self, _key: &TenantKey, _grant: &mut (), _actual: u64, _now: Instant) {}

    #[inline]
    fn release(&self, _key: &TenantKey, _grant: ()) {}

    #[inline]
    fn cancel(&self, _key: &TenantKey, _grant: (), _now: Instant) {}
}

/// Requests refused, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rejections {
    /// The tenant's own queue was full (HTTP 429).
    pub tenant_queue_full: u64,
    /// The whole queue was full (HTTP 503).
    pub queue_full: u64,
    /// The request waited its maximum queueing time, or would have waited past it for
    /// the rate.
    pub wait_timed_out: u64,
    /// The rate backend refused it for the tenant's own limit (a limit keyed by a tier).
    pub rate_limited: u64,
    /// Its cost is above what the rate backend can ever grant.
    pub cost_above_capacity: u64,
    /// It carried no tenant key.
    pub missing_key: u64,
    /// Anything else: a full key table, an unavailable backend.
    pub other: u64,
}

impl Rejections {
    fn count(&mut self, kind: ErrorKind) {
        let n = match kind {
            ErrorKind::TenantQueueFull => &mut self.tenant_queue_full,
            ErrorKind::QueueFull => &mut self.queue_full,
            ErrorKind::WaitTimedOut => &mut self.wait_timed_out,
            ErrorKind::RateLimited | ErrorKind::ConcurrencyLimited => &mut self.rate_limited,
            ErrorKind::CostAboveCapacity => &mut self.cost_above_capacity,
            ErrorKind::MissingKey => &mut self.missing_key,
            _ => &mut self.other,
        };
        *n += 1;
    }

    /// All of them.
    #[must_use]
    pub fn total(&self) -> u64 {
        self.tenant_queue_full
            + self.queue_full
            + self.wait_timed_out
            + self.rate_limited
            + self.cost_above_capacity
            + self.missing_key
            + self.other
    }
}

/// Counters of a [`FairQueueLayer`](super::FairQueueLayer), shared by all its services.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FairQueueLayerStats {
    /// Requests queued now.
    pub queued: usize,
    /// Tenants with requests queued now.
    pub backlogged_tenants: usize,
    /// Slots taken now: admitted requests not finished, granted requests not yet called,
    /// and the request at the rate gate.
    pub in_flight: usize,
    /// Whether a request waits at the rate gate now (the next in fair order, for the
    /// instant the rate lets it pass).
    pub waiting_for_rate: bool,
    /// Requests admitted (the inner service was or is being called).
    pub admitted: u64,
    /// Their total cost (saturating).
    pub admitted_cost: u64,
    /// Admitted requests that waited in the queue first.
    pub waited: u64,
    /// Their total queueing time.
    pub wait_time: Duration,
    /// The longest queueing time of an admitted request.
    pub max_wait: Duration,
    /// Waiting requests dropped by their caller (granted ones included: their grant
    /// went back).
    pub cancelled: u64,
    /// Requests refused, by reason.
    pub rejected: Rejections,
    /// Tenants whose counters are kept now (see
    /// [`FairQueueLayer::tracked_tenants`](super::FairQueueLayer::tracked_tenants)).
    pub tracked_tenants: usize,
}

/// One tenant's queue and counters, from
/// [`FairQueueLayer::tenant_stats`](super::FairQueueLayer::tenant_stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TenantQueueStats {
    /// Its configured weight.
    pub weight: u32,
    /// Its requests queued now.
    pub queued: usize,
    /// Their total cost.
    pub queued_cost: u64,
    /// Its requests admitted since its counters were created.
    pub admitted: u64,
    /// Their total cost (saturating).
    pub admitted_cost: u64,
    /// Its admitted requests that waited in the queue.
    pub waited: u64,
    /// Their total queueing time.
    pub wait_time: Duration,
}

/// What the layer was built with; never changes once services exist.
#[derive(Clone)]
pub(crate) struct Fixed<B> {
    pub(crate) backend: B,
    pub(crate) clock: LayerClock,
    /// `usize::MAX`: no concurrency cap.
    pub(crate) slots: usize,
    pub(crate) max_queue_time: Option<Duration>,
    pub(crate) default_key: Option<TenantKey>,
    pub(crate) config: FairQueueConfig,
    /// `config.weights`, keyed by the tenant keys they name.
    pub(crate) weights: HashMap<TenantKey, u32>,
    pub(crate) tracked_tenants: usize,
}

impl<B> Fixed<B> {
    pub(crate) fn new(config: FairQueueConfig, backend: B, slots: usize) -> Result<Self, PolicyError> {
        config.validate()?;
        let mut weights = HashMap::with_capacity(config.weights.len());
        for (name, &weight) in &config.weights {
            weights.insert(key_named(name)?, weight);
        }
        Ok(Fixed {
            backend,
            clock: LayerClock::default(),
            slots,
            max_queue_time: None,
            default_key: None,
            config,
            weights,
            tracked_tenants: 10_000,
        })
    }

    /// The weight of `key`: the entry of `config.weights` naming it, or the default.
    pub(crate) fn weight(&self, key: &TenantKey) -> u32 {
        if self.weights.is_empty() {
            return self.config.default_weight;
        }
        self.weights.get(key).copied().unwrap_or(self.config.default_weight)
    }
}

/// The tenant key a weight's name stands for: its parts joined by `/`, as
/// `TenantKey`'s `Display` writes it; the empty name is the global key.
fn key_named(name: &str) -> Result<TenantKey, PolicyError> {
    if name.is_empty() {
        return Ok(TenantKey::global());
    }
    TenantKey::new(name.split('/'))
        .map_err(|e| PolicyError::new(format!("weights[{name:?}]"), format!("not a tenant key: {e}")))
}

impl<B> fmt::Debug for Fixed<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FairQueueSettings")
            .field("slots", &(self.slots != usize::MAX).then_some(self.slots))
            .field("max_queue_time", &self.max_queue_time)
            .field("default_key", &self.default_key)
            .field("config", &self.config)
            .field("tracked_tenants", &self.tracked_tenants)
            .finish_non_exhaustive()
    }
}

/// The settings and the state behind the lock.
pub(crate) struct Shared<B: Backend> {
    pub(crate) fixed: Fixed<B>,
    state: Mutex<State<B>>,
}

impl<B: Backend> Shared<B> {
    pub(crate) fn new(fixed: Fixed<B>) -> Result<Self, PolicyError> {
        let queue = FairQueue::new(fixed.config.clone())?;
        let state = State {
            queue,
            in_flight: 0,
            gate: None,
            outcomes: HashMap::new(),
            counters: Counters::default(),
            records: Records { map: HashMap::new(), limit: fixed.tracked_tenants, cooldown: 0 },
        };
        Ok(Shared { fixed, state: Mutex::new(state) })
    }

    fn lock(&self) -> MutexGuard<'_, State<B>> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn clock(&self, floor: Instant) -> Now<'_> {
        Now { clock: &self.fixed.clock, floor, read: None }
    }

    /// A request arrives: admitted at once, queued, or refused.
    pub(crate) fn arrive(&self, key: &TenantKey, cost: u64) -> Arrival<B::Grant> {
        let mut wake = Wakers::default();
        let arrival = self.lock().arrive(&self.fixed, key, cost, &mut self.clock(Instant::ZERO), &mut wake);
        wake.wake();
        arrival
    }

    /// Counts a refusal made before the request reached the queue.
    pub(crate) fn count_refusal(&self, kind: ErrorKind) {
        self.lock().counters.rejected.count(kind);
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
    /// settle (`settled`), which may have given cost back, the gate's request is tried
    /// again at once.
    pub(crate) fn release(&self, settled: bool) {
        let mut wake = Wakers::default();
        self.lock().release(&self.fixed, &mut self.clock(Instant::ZERO), &mut wake, settled);
        wake.wake();
    }

    /// Now, on the layer's clock.
    pub(crate) fn now(&self) -> Instant {
        self.fixed.clock.now()
    }

    pub(crate) fn stats(&self) -> FairQueueLayerStats {
        let st = self.lock();
        let queue = st.queue.stats();
        let c = &st.counters;
        FairQueueLayerStats {
            queued: queue.queued,
            backlogged_tenants: queue.backlogged_tenants,
            in_flight: st.in_flight,
            waiting_for_rate: st.gate.is_some(),
            admitted: c.admitted,
            admitted_cost: c.admitted_cost,
            waited: c.waited,
            wait_time: Duration::from_nanos(c.wait_nanos),
            max_wait: Duration::from_nanos(c.max_wait_nanos),
            cancelled: c.cancelled,
            rejected: c.rejected,
            tracked_tenants: st.records.map.len(),
        }
    }

    pub(crate) fn tenant_stats(&self, key: &TenantKey) -> Option<TenantQueueStats> {
        let st = self.lock();
        let queued = st.queue.tenant_stats(key);
        let record = st.records.map.get(key);
        if queued.is_none() && record.is_none() {
            return None;
        }
        let mut stats = TenantQueueStats { weight: self.fixed.weight(key), ..TenantQueueStats::default() };
        if let Some(q) = queued {
            stats.queued = q.queued;
            stats.queued_cost = q.queued_cost;
        }
        if let Some(r) = record {
            stats.admitted = r.admitted;
            stats.admitted_cost = r.admitted_cost;
            stats.waited = r.waited;
            stats.wait_time = Duration::from_nanos(r.wait_nanos);
        }
        Some(stats)
    }
}

impl<B: Backend> fmt::Debug for Shared<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.fixed.fmt(f)
    }
}

/// What became of an arriving request.
pub(crate) enum Arrival<G> {
    /// Admitted at once: call the inner service.
    Admitted(G),
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

/// A grant and what the admission tells the tracing.
pub(crate) struct Admitted<G> {
    pub(crate) grant: G,
    pub(crate) waited: Duration,
}

/// A request in the fair queue.
struct Queued {
    waker: Option<Waker>,
    since: Instant,
    deadline: Option<Instant>,
}

/// The request chosen next, holding a slot, waiting for the rate.
struct Gate<B: Backend> {
    id: u64,
    key: TenantKey,
    cost: u64,
    since: Instant,
    deadline: Option<Instant>,
    waker: Option<Waker>,
    stage: Stage<B::Acquire>,
    /// A semaphore of the backend blocks it too: retry on every release.
    on_release: bool,
}

enum Stage<A> {
    /// Until the backend's instant.
    Sleeping(Instant),
    /// Until a semaphore of the backend is released.
    AwaitRelease,
    /// A remote acquisition in flight, polled by the gate's waiter.
    Acquiring(A),
}

enum Outcome<G> {
    Granted { grant: G, cost: u64, since: Instant, at: Instant },
    Refused(Box<LimitError>),
}

#[derive(Default)]
struct Counters {
    admitted: u64,
    admitted_cost: u64,
    waited: u64,
    wait_nanos: u64,
    max_wait_nanos: u64,
    cancelled: u64,
    rejected: Rejections,
}

/// Per-tenant counters, bounded: when full, the older half of the records of tenants
/// with nothing queued is dropped. A scan that frees little is not repeated for the next
/// `limit / 2` new tenants (their counters are not kept meanwhile), so insertion stays
/// amortized O(1) even when most tracked tenants are backlogged.
struct Records {
    map: HashMap<TenantKey, Record>,
    limit: usize,
    /// New tenants to turn away before the next scan.
    cooldown: usize,
}

#[derive(Default)]
struct Record {
    admitted: u64,
    admitted_cost: u64,
    waited: u64,
    wait_nanos: u64,
    last_admitted: Instant,
    /// The time between its last two admissions while it was backlogged (zero:
    /// unknown); estimates when its full queue will have room again.
    interval: Duration,
    /// Whether it still had requests queued at its last admission.
    backlogged: bool,
}

impl Records {
    fn update(&mut self, key: &TenantKey, queue: &FairQueue<TenantKey, Queued>, f: impl FnOnce(&mut Record)) {
        if let Some(record) = self.map.get_mut(key) {
            f(record);
            return;
        }
        if self.map.len() >= self.limit {
            if self.cooldown > 0 {
                self.cooldown -= 1;
                return;
            }
            self.evict(queue);
            if self.map.len() + self.limit / 4 > self.limit {
                self.cooldown = self.limit / 2;
            }
            if self.map.len() >= self.limit {
                return;
            }
        }
        let mut record = Record::default();
        f(&mut record);
        self.map.insert(key.clone(), record);
    }

    fn evict(&mut self, queue: &FairQueue<TenantKey, Queued>) {
        let idle = |key: &TenantKey| queue.tenant_stats(key).is_none_or(|t| t.queued == 0);
        let mut seen: Vec<Instant> = self.map.iter().filter(|(k, _)| idle(k)).map(|(_, r)| r.last_admitted).collect();
        if seen.is_empty() {
            return;
        }
        let middle = seen.len() / 2;
        let (_, &mut cut, _) = seen.select_nth_unstable(middle);
        self.map.retain(|k, r| r.last_admitted > cut || !idle(k));
    }
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

/// Wakers gathered under the lock, woken after it is released.
#[derive(Default)]
pub(crate) struct Wakers {
    first: Option<Waker>,
    rest: Vec<Waker>,
}

impl Wakers {
    fn push(&mut self, waker: Option<Waker>) {
        let Some(waker) = waker else { return };
        if self.first.is_none() {
            self.first = Some(waker);
        } else {
            self.rest.push(waker);
        }
    }

    pub(crate) fn wake(self) {
        if let Some(w) = self.first {
            w.wake();
        }
        for w in self.rest {
            w.wake();
        }
    }
}

fn set_waker(slot: &mut Option<Waker>, cx: &Context<'_>) {
    if !slot.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
        *slot = Some(cx.waker().clone());
    }
}

fn poll_once<F: Future + Unpin>(fut: &mut F) -> Poll<F::Output> {
    Pin::new(fut).poll(&mut Context::from_waker(Waker::noop()))
}

/// A denial that waiting at the gate can fix: a shared limit, not yet.
fn waitable(error: &AcquireError) -> bool {
    error.as_denial().is_some_and(|d| d.is_global())
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
    fn arrive(
        &mut self,
        fx: &Fixed<B>,
        key: &TenantKey,
        cost: u64,
        now: &mut Now<'_>,
        wake: &mut Wakers,
    ) -> Arrival<B::Grant> {
        let t = now.get();
        let deadline = fx.max_queue_time.map(|d| t + d);
        let item = Queued { waker: None, since: t, deadline };
        if !(self.queue.is_empty() && self.gate.is_none() && self.in_flight < fx.slots) {
            return match self.queue.enqueue(key.clone(), fx.weight(key), cost, item) {
                Ok(ticket) => {
                    self.pump(fx, now, wake);
                    Arrival::Queued(ticket)
                }
                Err(full) => Arrival::Refused(self.full(key, &full, t)),
            };
        }
        // Nothing queued and capacity free: skip the queue.
        let mut acquire = fx.backend.acquire(key, cost, t);
        match poll_once(&mut acquire) {
            Poll::Ready(Ok(grant)) => {
                self.in_flight += 1;
                self.count_admission(key, cost, None, t);
                Arrival::Admitted(grant)
            }
            Poll::Ready(Err(e)) if !waitable(&e) => {
                let error = Box::new(LimitError::from(e));
                self.counters.rejected.count(error.kind());
                Arrival::Refused(error)
            }
            result => {
                // Not yet (or a remote backend): to the gate, through the queue, so that
                // the request has a ticket. The queue was empty: it pops this request.
                let ticket = match self.queue.enqueue(key.clone(), fx.weight(key), cost, item) {
                    Ok(ticket) => ticket,
                    Err(full) => return Arrival::Refused(self.full(key, &full, t)),
                };
                if let Some(next) = self.queue.pop_next() {
                    self.in_flight += 1;
                    let gate = Gate {
                        id: next.ticket.arrival(),
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

    /// A full queue's refusal, with a `Retry-After` estimate for the tenant's own queue.
    fn full(&mut self, key: &TenantKey, full: &QueueFull<Queued>, now: Instant) -> Box<LimitError> {
        let kind = if full.kind() == QueueKind::Tenant { ErrorKind::TenantQueueFull } else { ErrorKind::QueueFull };
        self.counters.rejected.count(kind);
        let mut error = LimitError::new(kind).with_detail(full.to_string());
        if kind == ErrorKind::TenantQueueFull {
            error.retry_after = self.records.map.get(key).and_then(|r| {
                let due = r.interval.saturating_sub(now.saturating_since(r.last_admitted));
                Some(if due.is_zero() { r.interval } else { due }).filter(|d| !d.is_zero())
            });
        }
        Box::new(error)
    }

    /// Dispatches in fair order while capacity is free.
    fn pump(&mut self, fx: &Fixed<B>, now: &mut Now<'_>, wake: &mut Wakers) {
        while self.gate.is_none() && self.in_flight < fx.slots {
            let Some(next) = self.queue.pop_next() else { break };
            self.in_flight += 1;
            let gate = Gate {
                id: next.ticket.arrival(),
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
    fn begin(&mut self, fx: &Fixed<B>, gate: Gate<B>, now: &mut Now<'_>, wake: &mut Wakers) {
        let now_at = now.get();
        if gate.deadline.is_some_and(|d| now_at >= d) {
            self.free_slot();
            self.refuse(gate.id, queue_timeout(), gate.waker, wake);
            return;
        }
        let mut acquire = fx.backend.acquire(&gate.key, gate.cost, now_at);
        match poll_once(&mut acquire) {
            Poll::Ready(result) => self.resolve(gate, result, now, wake),
            Poll::Pending => self.await_remote(gate, acquire, wake),
        }
    }

    fn await_remote(&mut self, mut gate: Gate<B>, acquire: B::Acquire, wake: &mut Wakers) {
        gate.stage = Stage::Acquiring(acquire);
        wake.push(gate.waker.clone());
        self.gate = Some(gate);
    }

    /// The backend answered for the gate's request (which holds a slot).
    fn resolve(
        &mut self,
        mut gate: Gate<B>,
        result: Result<B::Grant, AcquireError>,
        now: &mut Now<'_>,
        wake: &mut Wakers,
    ) {
        let error = match result {
            Ok(grant) => {
                let outcome = Outcome::Granted { grant, cost: gate.cost, since: gate.since, at: now.get() };
                self.outcomes.insert(gate.id, outcome);
                wake.push(gate.waker);
                return;
            }
            Err(e) => e,
        };
        let denial = match error.as_denial() {
            Some(d) if d.is_global() => *d,
            _ => {
                self.free_slot();
                self.refuse(gate.id, Box::new(LimitError::from(error)), gate.waker, wake);
                return;
            }
        };
        let wait = denial.retry_after();
        gate.on_release = denial.needs_release();
        gate.stage = if wait.is_zero() && denial.needs_release() {
            Stage::AwaitRelease
        } else {
            let at = now.get() + wait.max(MIN_RETRY);
            if gate.deadline.is_some_and(|d| at >= d) {
                // It would pass only at or after its deadline: refuse now, free the gate.
                self.free_slot();
                let error = LimitError { kind: ErrorKind::WaitTimedOut, ..LimitError::from(error) };
                self.refuse(gate.id, Box::new(error), gate.waker, wake);
                return;
            }
            Stage::Sleeping(at)
        };
        // The gate's waiter owns the timer now: wake it to arm it.
        wake.push(gate.waker.clone());
        self.gate = Some(gate);
    }

    fn refuse(&mut self, id: u64, error: Box<LimitError>, waker: Option<Waker>, wake: &mut Wakers) {
        self.counters.rejected.count(error.kind());
        self.outcomes.insert(id, Outcome::Refused(error));
        wake.push(waker);
    }

    /// Retries the gate's request now (a refund or a release may have made room), then
    /// pumps.
    fn retry_gate(&mut self, fx: &Fixed<B>, now: &mut Now<'_>, wake: &mut Wakers) {
        if let Some(gate) = self.gate.take() {
            if let Stage::Acquiring(_) = gate.stage {
                self.gate = Some(gate);
                return;
            }
            self.begin(fx, gate, now, wake);
        }
        self.pump(fx, now, wake);
    }

    fn count_admission(&mut self, key: &TenantKey, cost: u64, waited: Option<Duration>, now: Instant) {
        let c = &mut self.counters;
        c.admitted += 1;
        c.admitted_cost = c.admitted_cost.saturating_add(cost);
        let wait_nanos = waited.map(|w| u64::try_from(w.as_nanos()).unwrap_or(u64::MAX));
        if let Some(n) = wait_nanos {
            c.waited += 1;
            c.wait_nanos = c.wait_nanos.saturating_add(n);
            c.max_wait_nanos = c.max_wait_nanos.max(n);
        }
        let backlogged = waited.is_some() && self.queue.tenant_stats(key).is_some_and(|t| t.queued > 0);
        self.records.update(key, &self.queue, |r| {
            r.admitted += 1;
            r.admitted_cost = r.admitted_cost.saturating_add(cost);
            if let Some(n) = wait_nanos {
                r.waited += 1;
                r.wait_nanos = r.wait_nanos.saturating_add(n);
            }
            if r.backlogged {
                r.interval = now.saturating_since(r.last_admitted);
            }
            r.last_admitted = now;
            r.backlogged = backlogged;
        });
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
                self.counters.rejected.count(error.kind());
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
                        self.counters.rejected.count(error.kind());
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
                WaiterStep::Done(Ok(Admitted { grant, waited }))
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

    fn free_slot(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// An admitted request let go of its slot.
    fn release(&mut self, fx: &Fixed<B>, now: &mut Now<'_>, wake: &mut Wakers, settled: bool) {
        self.free_slot();
        if settled || self.gate.as_ref().is_some_and(|g| g.on_release) {
            self.retry_gate(fx, now, wake);
        } else {
            self.pump(fx, now, wake);
        }
    }
}
