//! The waiting machine: where a refused request waits, and who wakes it.
//!
//! A layer with a `max_wait` lets a refused request wait instead of failing. Waiting has
//! two orders and one rule about waking.
//!
//! **FIFO per key.** The waiters of one key form a queue of tickets; only its head tries
//! to acquire, so a key's requests pass in arrival order. When the head leaves (granted,
//! refused, timed out or dropped) it hands the turn to the next ticket of its key.
//!
//! **FIFO per blocking state.** A head refused by a rate limit sleeps until the exact
//! instant the backend named: its own timer, nobody else's wake-up. A head refused by a
//! concurrency limit *parks* on the state that refused it: the limit, and the part of
//! its key the limit is kept by (the `org` of `org/user` for a per-org semaphore; nothing
//! for a global one). A release by a request of key `k` frees exactly the states `k`
//! holds, so it wakes the first parked head of each of those states and no one else.
//! A woken head tries again:
//! - granted: it leaves its state's queue and wakes the next one there, since the
//!   release may have freed more than it took (a chain that stops at the first waiter
//!   that does not fit);
//! - refused by the same state: it keeps its place at the front, so a large request is
//!   never starved by smaller ones behind it; the holders of that state will release
//!   again, or its deadline passes;
//! - refused by another state, or dropped: it leaves and hands its wake-up to the next.
//!
//! No wake-up is lost between a failed attempt and parking: every release bumps an
//! epoch under the lock, and a head that parks after an epoch change it did not see tries
//! again at once. When a backend cannot say how deep a tier's states are
//! ([`Backend::tier_depth`](tower_limits_core::Backend::tier_depth) answers `None`),
//! every release of that limit wakes all of its parked heads, which is still correct,
//! only less targeted.
//!
//! Wakers are gathered under the lock and woken after it is released ([`Wakers`]); the
//! weighted-fair queue wakes its gate the same way.
//!
//! Everything is cancel-safe: a dropped waiter's [`Ticket`] leaves its key queue and its
//! parking place, passing on the turn and any wake-up it held.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use hashbrown::HashMap;
use tower_limits_core::TenantKey;

/// Wakers gathered under a lock, to be woken once it is released: no task is woken while
/// the lock is held. One waker, the usual case, needs no allocation.
#[derive(Default)]
pub(crate) struct Wakers {
    first: Option<Waker>,
    rest: Vec<Waker>,
}

impl Wakers {
    pub(crate) fn push(&mut self, waker: Option<Waker>) {
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

/// Stores the waker of `cx` in `slot`, unless the one there already wakes the same task.
pub(crate) fn set_waker(slot: &mut Option<Waker>, cx: &Context<'_>) {
    if !slot.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
        *slot = Some(cx.waker().clone());
    }
}

/// The state a concurrency refusal named: a limit, and the part of the key it is kept by.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Blocked {
    limit: &'static str,
    /// How many parts of the key the limit's state is kept by; `None` when the backend
    /// cannot say (every release of the limit then wakes its waiters).
    depth: Option<usize>,
    prefix: Box<[u8]>,
}

impl Blocked {
    /// The state of `limit` (scoped to a tier `depth` parts deep, `Some(0)` for a global
    /// limit) that `key` was refused by.
    pub(crate) fn new(limit: &'static str, depth: Option<usize>, key: &TenantKey) -> Self {
        let prefix = depth.and_then(|d| key.prefix(d)).unwrap_or_default();
        Blocked { limit, depth, prefix: prefix.into() }
    }
}

struct Parked {
    ticket: u64,
    waker: Option<Waker>,
    /// Told to try again, and has not yet come back.
    woken: bool,
}

#[derive(Default)]
struct Inner {
    /// The tickets of each key's waiters, in arrival order.
    keys: HashMap<TenantKey, VecDeque<(u64, Option<Waker>)>>,
    next: u64,
    len: usize,
    /// The heads parked on each blocking state, in the order they parked.
    parked: HashMap<Blocked, VecDeque<Parked>>,
    /// Where each parked ticket is.
    parked_at: HashMap<u64, Blocked>,
    /// The distinct (limit, depth) shapes that have parked heads, with their counts.
    shapes: Vec<(&'static str, Option<usize>, usize)>,
}

/// The waiters of one layer: per-key queues and the heads parked on concurrency.
#[derive(Default)]
pub(crate) struct Waiters {
    inner: Mutex<Inner>,
    /// How many requests wait: a release with nobody waiting takes no lock.
    waiting: AtomicUsize,
    /// Bumped by every release that finds someone waiting.
    epoch: AtomicU64,
}

impl Waiters {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How many requests wait now.
    pub(crate) fn len(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// Whether anyone waits for `key` (a newcomer must then queue behind them).
    pub(crate) fn has_waiters(&self, key: &TenantKey) -> bool {
        self.len() > 0 && self.lock().keys.contains_key(key)
    }

    /// Joins the queue of `key`, unless `max` requests already wait.
    pub(crate) fn join<'a>(&'a self, key: &TenantKey, max: usize) -> Option<Ticket<'a>> {
        let mut q = self.lock();
        if q.len >= max {
            return None;
        }
        q.next += 1;
        let ticket = q.next;
        q.keys.entry(key.clone()).or_default().push_back((ticket, None));
        q.len += 1;
        self.waiting.store(q.len, Ordering::SeqCst);
        Some(Ticket { waiters: self, key: key.clone(), ticket })
    }

    /// The epoch to read before an attempt whose refusal may lead to parking.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// A request of `key` released what it held: wake the first parked head of every
    /// state `key` held.
    pub(crate) fn released(&self, key: &TenantKey) {
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut wake = Wakers::default();
        {
            let mut q = self.lock();
            self.epoch.fetch_add(1, Ordering::AcqRel);
            let Inner { parked, shapes, .. } = &mut *q;
            for &(limit, depth, _) in shapes.iter() {
                match depth {
                    Some(d) => {
                        let Some(prefix) = key.prefix(d) else { continue };
                        let state = Blocked { limit, depth, prefix: prefix.into() };
                        if let Some(queue) = parked.get_mut(&state) {
                            wake_first(queue, &mut wake);
                        }
                    }
                    None => {
                        let state = Blocked { limit, depth: None, prefix: Box::default() };
                        for p in parked.get_mut(&state).into_iter().flatten() {
                            p.woken = true;
                            wake.push(p.waker.take());
                        }
                    }
                }
            }
        }
        wake.wake();
    }
}

/// Wakes the first head of a state's queue, unless it is already trying again.
fn wake_first(queue: &mut VecDeque<Parked>, wake: &mut Wakers) {
    if let Some(first) = queue.front_mut() {
        if !first.woken {
            first.woken = true;
            wake.push(first.waker.take());
        }
    }
}

impl Inner {
    /// Removes `ticket` from its parking place; if it held a wake-up, passes it on.
    fn unpark(&mut self, ticket: u64, wake: &mut Wakers) {
        let Some(state) = self.parked_at.remove(&ticket) else { return };
        let Some(queue) = self.parked.get_mut(&state) else { return };
        let Some(i) = queue.iter().position(|p| p.ticket == ticket) else { return };
        let was_woken = queue.remove(i).is_some_and(|p| p.woken);
        if was_woken {
            wake_first(queue, wake);
        }
        if queue.is_empty() {
            self.parked.remove(&state);
        }
        if let Some(i) = self.shapes.iter().position(|&(l, d, _)| l == state.limit && d == state.depth) {
            self.shapes[i].2 -= 1;
            if self.shapes[i].2 == 0 {
                self.shapes.swap_remove(i);
            }
        }
    }
}

/// A waiter's place: in its key's queue, and, while a concurrency limit blocks it, on the
/// state that blocked it. Dropping it leaves both and passes on what it held.
pub(crate) struct Ticket<'a> {
    waiters: &'a Waiters,
    key: TenantKey,
    ticket: u64,
}

impl Ticket<'_> {
    /// Ready when this ticket is at the head of its key's queue.
    pub(crate) async fn head(&self) {
        std::future::poll_fn(|cx| {
            let mut q = self.waiters.lock();
            let Some(queue) = q.keys.get_mut(&self.key) else { return Poll::Ready(()) };
            match queue.iter_mut().position(|(t, _)| *t == self.ticket) {
                Some(0) | None => Poll::Ready(()),
                Some(i) => {
                    set_waker(&mut queue[i].1, cx);
                    Poll::Pending
                }
            }
        })
        .await;
    }

    /// The attempt begun at `epoch` was refused by `state`: park there until a release of
    /// it wakes this ticket. Ready at once if a release came since `epoch`.
    pub(crate) async fn park(&self, state: &Blocked, epoch: u64) {
        let mut first = true;
        std::future::poll_fn(|cx| self.poll_park(state, epoch, std::mem::take(&mut first), cx)).await;
    }

    fn poll_park(&self, state: &Blocked, epoch: u64, first: bool, cx: &Context<'_>) -> Poll<()> {
        let mut wake = Wakers::default();
        let ready = {
            let mut q = self.waiters.lock();
            if q.parked_at.get(&self.ticket).is_some_and(|s| s != state) {
                q.unpark(self.ticket, &mut wake);
            }
            if !q.parked_at.contains_key(&self.ticket) {
                q.parked_at.insert(self.ticket, state.clone());
                let queue = q.parked.entry(state.clone()).or_default();
                queue.push_back(Parked { ticket: self.ticket, waker: None, woken: false });
                match q.shapes.iter_mut().find(|(l, d, _)| *l == state.limit && *d == state.depth) {
                    Some(shape) => shape.2 += 1,
                    None => q.shapes.push((state.limit, state.depth, 1)),
                }
            }
            let released_since = self.waiters.epoch.load(Ordering::Acquire) != epoch;
            let queue = q.parked.get_mut(state);
            match queue.and_then(|queue| queue.iter_mut().find(|p| p.ticket == self.ticket)) {
                Some(p) if first => {
                    // A new attempt: any earlier wake-up has been used.
                    p.woken = false;
                    set_waker(&mut p.waker, cx);
                    released_since
                }
                Some(p) if p.woken => true,
                Some(p) => {
                    set_waker(&mut p.waker, cx);
                    false
                }
                None => true,
            }
        };
        wake.wake();
        if ready { Poll::Ready(()) } else { Poll::Pending }
    }

    /// The last attempt was granted, or refused for something other than concurrency:
    /// leave the parking place, passing on a wake-up (a grant may have left room).
    pub(crate) fn unpark(&self) {
        let mut wake = Wakers::default();
        self.waiters.lock().unpark(self.ticket, &mut wake);
        wake.wake();
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let mut wake = Wakers::default();
        {
            let mut q = self.waiters.lock();
            q.unpark(self.ticket, &mut wake);
            if let Some(queue) = q.keys.get_mut(&self.key) {
                if let Some(i) = queue.iter().position(|(t, _)| *t == self.ticket) {
                    queue.remove(i);
                    if i == 0 {
                        if let Some((_, w)) = queue.front_mut() {
                            wake.push(w.take());
                        }
                    }
                    if queue.is_empty() {
                        q.keys.remove(&self.key);
                    }
                    q.len -= 1;
                    self.waiters.waiting.store(q.len, Ordering::Relaxed);
                }
            }
        }
        wake.wake();
    }
}
