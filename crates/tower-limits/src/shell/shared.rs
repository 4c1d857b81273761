//! The state every service of one layer shares: the backend, the clock, the settings and
//! the waiters.
//!
//! # Waiting
//!
//! With a `max_wait`, a refused request may wait instead of failing. Waiters of one key
//! form a FIFO queue (a `VecDeque` of tickets per key, in one map behind a mutex); only
//! the head of a key's queue tries to acquire, so arrival order is kept. The head sleeps
//! until the exact instant the backend said the request would pass, or, when a
//! concurrency limit blocks, until a permit is released (a `Notify` that every release
//! signals while waiting is on) or its deadline passes. When the head leaves (granted,
//! failed or dropped), it removes its ticket and wakes the next; wakers are collected
//! under the lock and woken after it is released. A dropped waiter's ticket guard
//! removes it wherever it is in its queue, so cancellation leaks nothing.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::sync::Notify;
use tower_limits_core::{LimitSet, LimitSetPolicy, Scope, TenantKey};

use crate::clock::LayerClock;

/// What to do with the cost charged for a request that did not complete normally.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Unfinished {
    /// Give it back: the request is treated as if it never happened.
    Refund,
    /// Keep it charged: the work may have been done.
    #[default]
    Keep,
}

#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) default_key: Option<TenantKey>,
    pub(crate) max_wait: Option<Duration>,
    pub(crate) max_waiters: usize,
    pub(crate) on_error: Unfinished,
    pub(crate) on_cancel: Unfinished,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            default_key: None,
            max_wait: None,
            max_waiters: 10_000,
            on_error: Unfinished::Keep,
            on_cancel: Unfinished::Keep,
        }
    }
}

/// Counters of a limit layer (the limits keep their own).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LayerStats {
    /// Requests refused (all reasons).
    pub rejected: u64,
    /// Requests that waited before being admitted.
    pub waited: u64,
    /// Requests that gave up waiting (their wait would have passed `max_wait`).
    pub wait_timeouts: u64,
    /// Requests waiting now.
    pub waiting: u64,
}

pub(crate) struct Shared<B> {
    pub(crate) backend: B,
    /// The policy an in-memory backend was built from, when there is one.
    pub(crate) source: Option<Source<B>>,
    pub(crate) clock: LayerClock,
    pub(crate) settings: Settings,
    pub(crate) waiters: Waiters,
    pub(crate) rejected: AtomicU64,
    pub(crate) waited: AtomicU64,
    pub(crate) wait_timeouts: AtomicU64,
}

impl<B> Shared<B> {
    pub(crate) fn new(backend: B, clock: LayerClock, settings: Settings) -> Self {
        Shared {
            backend,
            source: None,
            clock,
            settings,
            waiters: Waiters::default(),
            rejected: AtomicU64::new(0),
            waited: AtomicU64::new(0),
            wait_timeouts: AtomicU64::new(0),
        }
    }

    pub(crate) fn layer_stats(&self) -> LayerStats {
        LayerStats {
            rejected: self.rejected.load(Ordering::Relaxed),
            waited: self.waited.load(Ordering::Relaxed),
            wait_timeouts: self.wait_timeouts.load(Ordering::Relaxed),
            waiting: self.waiters.len() as u64,
        }
    }
}

impl<B> fmt::Debug for Shared<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared").field("settings", &self.settings).finish_non_exhaustive()
    }
}

/// The policy a layer's backend was built from, and how to build it again: a named
/// single-limit layer starts global and becomes per key when it is given a key extractor.
pub(crate) struct Source<B> {
    pub(crate) policy: LimitSetPolicy,
    /// A named layer's one global limit, still to be scoped per key by `key`.
    pub(crate) single: bool,
    build: fn(LimitSetPolicy) -> B,
}

impl<B> Clone for Source<B> {
    fn clone(&self) -> Self {
        Source { policy: self.policy.clone(), single: self.single, build: self.build }
    }
}

/// The tier a named layer's limit is keyed by once it has a key extractor.
pub(crate) const KEY_TIER: &str = "key";

impl Source<LimitSet> {
    pub(crate) fn memory(policy: LimitSetPolicy) -> Self {
        Source { policy, single: false, build: rebuild }
    }

    pub(crate) fn single(policy: LimitSetPolicy) -> Self {
        Source { policy, single: true, build: rebuild }
    }
}

fn rebuild(policy: LimitSetPolicy) -> LimitSet {
    // Only policies that built once, scoped by one more tier, come here.
    LimitSet::new(policy).unwrap_or_else(|e| unreachable!("a valid policy scoped per key is valid: {e}"))
}

impl<B> Source<B> {
    /// The same limits, each kept per key.
    pub(crate) fn keyed(&self) -> Self {
        let mut policy = self.policy.clone();
        policy.tiers = vec![KEY_TIER.to_owned()];
        for limit in &mut policy.limits {
            limit.scope = Scope::Tier(KEY_TIER.to_owned());
        }
        Source { policy, single: false, build: self.build }
    }

    /// A backend enforcing this source's policy.
    pub(crate) fn backend(&self) -> B {
        (self.build)(self.policy.clone())
    }
}

/// Per-key FIFO queues of waiting requests.
#[derive(Default)]
pub(crate) struct Waiters {
    queues: Mutex<Queues>,
    /// Signalled on every release of a permit while anyone waits.
    pub(crate) released: Notify,
}

#[derive(Default)]
struct Queues {
    by_key: HashMap<TenantKey, VecDeque<(u64, Option<Waker>)>>,
    next: u64,
    len: usize,
}

impl Waiters {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queues> {
        self.queues.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn len(&self) -> usize {
        self.lock().len
    }

    /// Whether anyone waits for `key` (a newcomer must then queue behind them).
    pub(crate) fn has_waiters(&self, key: &TenantKey) -> bool {
        let q = self.lock();
        q.len > 0 && q.by_key.contains_key(key)
    }

    /// Joins the queue of `key`, unless `max` requests already wait.
    pub(crate) fn join(&self, key: &TenantKey, max: usize) -> Option<u64> {
        let mut q = self.lock();
        if q.len >= max {
            return None;
        }
        q.next += 1;
        let ticket = q.next;
        q.by_key.entry(key.clone()).or_default().push_back((ticket, None));
        q.len += 1;
        Some(ticket)
    }

    /// Ready when `ticket` is at the head of its key's queue.
    pub(crate) fn poll_head(&self, key: &TenantKey, ticket: u64, cx: &mut Context<'_>) -> Poll<()> {
        let mut q = self.lock();
        let Some(queue) = q.by_key.get_mut(key) else { return Poll::Ready(()) };
        match queue.iter_mut().position(|(t, _)| *t == ticket) {
            Some(0) | None => Poll::Ready(()),
            Some(i) => {
                queue[i].1 = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }

    /// Leaves the queue; if `ticket` was the head, wakes the next waiter.
    pub(crate) fn leave(&self, key: &TenantKey, ticket: u64) {
        let wake = {
            let mut q = self.lock();
            let Some(queue) = q.by_key.get_mut(key) else { return };
            let Some(i) = queue.iter().position(|(t, _)| *t == ticket) else { return };
            queue.remove(i);
            let wake = if i == 0 { queue.front_mut().and_then(|(_, w)| w.take()) } else { None };
            if queue.is_empty() {
                q.by_key.remove(key);
            }
            q.len -= 1;
            wake
        };
        if let Some(w) = wake {
            w.wake();
        }
    }
}

/// A place in a key's queue; leaving it (on drop) wakes the next waiter.
pub(crate) struct Ticket<'a> {
    pub(crate) waiters: &'a Waiters,
    pub(crate) key: TenantKey,
    pub(crate) ticket: u64,
}

impl Ticket<'_> {
    pub(crate) async fn head(&self) {
        std::future::poll_fn(|cx| self.waiters.poll_head(&self.key, self.ticket, cx)).await;
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.waiters.leave(&self.key, self.ticket);
    }
}
