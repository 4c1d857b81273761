//! The gate: the one request the scheduler chose next, holding a slot, waiting for the
//! rate backend to grant it; what becomes of it.
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

use std::task::Waker;
use std::time::Duration;

use tower_limits_core::{AcquireError, Backend, Instant, TenantKey};

use super::{Fixed, Now, State, Wakers};
use crate::error::{ErrorKind, LimitError};

/// The shortest retry after a refusal that names no wait (a backend that cannot say).
const MIN_RETRY: Duration = Duration::from_millis(1);

/// The request chosen next, holding a slot, waiting for the rate.
pub(super) struct Gate<B: Backend> {
    pub(super) id: u64,
    pub(super) key: TenantKey,
    /// The band it waited in.
    pub(super) band: usize,
    pub(super) cost: u64,
    pub(super) since: Instant,
    pub(super) deadline: Option<Instant>,
    pub(super) waker: Option<Waker>,
    pub(super) stage: Stage<B::Acquire>,
    /// A semaphore of the backend blocks it too: retry on every release.
    pub(super) on_release: bool,
}

pub(super) enum Stage<A> {
    /// Until the backend's instant.
    Sleeping(Instant),
    /// Until a semaphore of the backend is released.
    AwaitRelease,
    /// A remote acquisition in flight, polled by the gate's waiter.
    Acquiring(A),
}

pub(super) enum Outcome<G> {
    Granted { grant: G, cost: u64, since: Instant, at: Instant },
    Refused(Box<LimitError>),
}

/// A refusal that waiting at the gate can fix: a shared limit, not yet.
pub(super) fn waitable(error: &AcquireError) -> bool {
    error.as_refusal().is_some_and(|d| d.is_global())
}

impl<B: Backend> State<B> {
    pub(super) fn await_remote(&mut self, mut gate: Gate<B>, acquire: B::Acquire, wake: &mut Wakers) {
        gate.stage = Stage::Acquiring(acquire);
        wake.push(gate.waker.clone());
        self.gate = Some(gate);
    }

    /// The backend answered for the gate's request (which holds a slot).
    pub(super) fn resolve(
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
        let refusal = match error.as_refusal() {
            Some(d) if d.is_global() => *d,
            _ => {
                self.free_slot();
                self.refuse(gate.id, Box::new(LimitError::from(error)), gate.waker, wake);
                return;
            }
        };
        let wait = refusal.retry_after();
        gate.on_release = refusal.needs_release();
        gate.stage = if wait.is_zero() && refusal.needs_release() {
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

    pub(super) fn refuse(&mut self, id: u64, error: Box<LimitError>, waker: Option<Waker>, wake: &mut Wakers) {
        self.counters.refused.count(error.kind());
        self.outcomes.insert(id, Outcome::Refused(error));
        wake.push(waker);
    }

    /// Retries the gate's request now (a refund or a release may have made room), then
    /// pumps.
    pub(super) fn retry_gate(&mut self, fx: &Fixed<B>, now: &mut Now<'_>, wake: &mut Wakers) {
        if let Some(gate) = self.gate.take() {
            if let Stage::Acquiring(_) = gate.stage {
                self.gate = Some(gate);
                return;
            }
            self.begin(fx, gate, now, wake);
        }
        self.pump(fx, now, wake);
    }
}
